"""Sharding benchmark: per-rank model-state memory and steps/s of DeepSpeed ZeRO 1/2/3 (with and without
CPU offload) against the FSDP2 backend, on the same dp2 layout, side by side in one run.

Run from the repository root:  python -m benchmarks.sharding_bench
Writes benchmarks/results/sharding.json.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer, seed_everything
from torch.distributed.tensor import DTensor

from benchmarks.workloads import StepTimer, TokenData
from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.launch import run_ranks
from lightning_llmpar.models import GPTModule

OUT = Path(__file__).parent / "results" / "sharding.json"
MODEL = dict(vocab_size=64, block_size=16, n_layer=8, n_head=8, n_kv_head=8, n_embd=512)
STEPS, BATCH = 8, 4


def state_bytes(*roots: Any, max_depth: int = 6) -> int:
    """Bytes of every distinct tensor storage reachable from the model and optimizer objects.

    Walks parameters, gradients, optimizer state and the attributes of optimizer/engine objects
    (DeepSpeed keeps flat partitions and master copies there), counting each storage once; a
    DTensor counts its local shard. Taken after an optimizer step, it is the rank's model state.
    """
    seen: set[int] = set()
    visited: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes() > 0:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    def walk(obj: Any, depth: int) -> None:
        if depth > max_depth or id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            add(obj)
            if obj.grad is not None:
                add(obj.grad)
        elif isinstance(obj, torch.nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                walk(t, depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                walk(v, depth + 1)
        elif type(obj).__module__.startswith(("deepspeed", "torch.optim", "lightning")) and hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                walk(v, depth + 1)

    for root in roots:
        walk(root, 0)
    return total


class _Probe(StepTimer):
    """Step times, and the parameter and optimizer state bytes after the second step."""

    def __init__(self) -> None:
        super().__init__()
        self.state = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        if trainer.global_step == 2:
            self.state = state_bytes(pl_module, trainer.optimizers, getattr(trainer.strategy, "engine", None))


def run(kwargs: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    module = GPTModule(**MODEL)
    params = sum(p.numel() for p in module.parameters())
    probe = _Probe()
    trainer = Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=LLMParallelStrategy(**kwargs),
                      max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, callbacks=[probe], use_distributed_sampler=False)
    trainer.fit(module, datamodule=TokenData(BATCH, n=BATCH * 2 * (STEPS + 1)))
    steady = probe.times[2:]
    return {"params": params, "state_bytes": probe.state, "steps_per_s": len(steady) / sum(steady)}


def formula_bytes(params: int, stage: int, dp: int) -> int:
    """fp32 AdamW model states per rank: weights 4P, gradients 4P, two moments 8P; ZeRO divides them."""
    weights = 4 * params / (dp if stage == 3 else 1)
    grads = 4 * params / (dp if stage >= 2 else 1)
    optim = 8 * params / (dp if stage >= 1 else 1)
    return int(weights + grads + optim)


def main() -> None:
    dp = 2
    cases = [
        ("fsdp2", {"zero_stage": 0}), ("fsdp2", {"zero_stage": 1}), ("fsdp2", {"zero_stage": 2}), ("fsdp2", {"zero_stage": 3}),
        ("deepspeed", {"zero_stage": 1}), ("deepspeed", {"zero_stage": 2}), ("deepspeed", {"zero_stage": 3}),
        ("deepspeed", {"zero_stage": 2, "offload_optimizer": "cpu"}),
        ("deepspeed", {"zero_stage": 3, "offload_optimizer": "cpu", "offload_parameters": "cpu"}),
    ]
    rows = []
    for backend, kw in cases:
        outs = run_ranks(run, dp, {"sharding_backend": backend, **kw}, timeout=1800)
        params = outs[0]["params"]
        row = {
            "backend": backend, **kw,
            "params": params,
            "formula_model_state_mb_per_rank": round(formula_bytes(params, kw["zero_stage"], dp) / 2**20, 1),
            "measured_model_state_mb_per_rank": [round(o["state_bytes"] / 2**20, 1) for o in outs],
            "steps_per_s": round(min(o["steps_per_s"] for o in outs), 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__, "dp": dp,
              "model": MODEL, "batch_per_rank": BATCH, "rows": rows,
              "note": "model state = distinct tensor storages reachable from parameters, gradients, optimizer"
                      " state and DeepSpeed's engine/optimizer objects after step 2, per rank. On a CPU-only"
                      " host every byte is host memory: for the offload rows the figure is the host memory the"
                      " offloaded state takes, compared with the formula."}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(f"-> {OUT}")


if __name__ == "__main__":
    main()
