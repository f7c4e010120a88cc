"""Context parallelism, measured: activation bytes per rank for one sequence at cp1/2/4, the longest sequence that
fits a per-rank activation cap, and tokens per second at equal global tokens (example GPT, ring attention).

Activation bytes are what autograd saves for backward during the first training step's forward (each storage
counted once, parameters left out), on every rank; the figure per layout is the largest rank's.

Run from the repository root:  python -m benchmarks.cp_ep_bench [--seq 2048] [--cap-mib MIB] [--steps 3]
Writes benchmarks/results/cp_ep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.models import GPTModule
from tests.distributed import run_ranks

OUT = Path(__file__).parent / "results" / "cp_ep.json"
MODEL = dict(vocab_size=256, n_layer=4, n_head=4, n_kv_head=2, n_embd=128)
SEQS = (1024, 2048, 4096, 8192)


class _Tokens(LightningDataModule):
    """One random sequence per step, the same on every context-parallel rank."""

    def __init__(self, seq: int, steps: int) -> None:
        super().__init__()
        self.seq, self.steps = seq, steps

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, MODEL["vocab_size"], (self.steps, self.seq + 1), generator=g)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        sampler = DistributedSampler(data, shuffle=False, **kwargs) if kwargs else None
        return DataLoader(data, batch_size=1, sampler=sampler)


class _Measure(Callback):
    """Saved-for-backward bytes of the first step's forward, and each step's wall time."""

    def __init__(self) -> None:
        self.saved_bytes = 0
        self.times: list[float] = []
        self._hooks: Any = None
        self._seen: set[int] = set()
        self._params: set[int] = set()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return t  # weights (FSDP's gathered ones are the modules' parameters during forward)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self._seen and ptr not in self._params:
            self._seen.add(ptr)
            self.saved_bytes += t.untyped_storage().nbytes()
        return t

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        self.start = time.perf_counter()
        if idx == 0:
            # Parameters are not activations.
            self._params = {p.untyped_storage().data_ptr() for p in pl_module.parameters()
                            if p.numel() and not isinstance(p, DTensor)}
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()

    def on_before_backward(self, trainer: Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.times.append(time.perf_counter() - self.start)


def _run(seqs: list[int], steps: int) -> list[dict[str, Any]]:
    """On each rank of one launch (its size is the cp degree): a short run per sequence length."""
    env = dict(os.environ)
    cp = int(env.get("WORLD_SIZE", "1"))
    rows = []
    for seq in seqs:
        os.environ.update(env)
        seed_everything(0, verbose=False)
        measure = _Measure()
        strategy: Any = "auto" if cp == 1 else LLMParallelStrategy(context_parallel=cp)
        trainer = Trainer(accelerator="cpu", devices=cp, strategy=strategy, max_steps=steps, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          use_distributed_sampler=False, callbacks=[measure], limit_val_batches=0)
        module = GPTModule(**MODEL, block_size=seq, learning_rate=1e-3, warmup_steps=1, total_steps=steps)
        trainer.fit(module, datamodule=_Tokens(seq, steps))
        rows.append({"seq": seq, "saved_bytes": measure.saved_bytes, "step_s": statistics.median(measure.times[1:])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048, help="the sequence for the bytes and speed comparison")
    parser.add_argument("--cap-mib", type=float, default=None,
                        help="per-rank activation cap for the longest sequence (default: what cp1 saves at --seq)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[int, dict[int, dict[str, float]]] = {}
    for cp in (1, 2, 4):
        per_rank = run_ranks(_run, cp, seqs=list(SEQS), steps=args.steps, timeout=1800)
        results[cp] = {row["seq"]: {"saved_bytes": max(r[i]["saved_bytes"] for r in per_rank),
                                    "step_s": max(r[i]["step_s"] for r in per_rank)}
                       for i, row in enumerate(per_rank[0])}
    base = results[1][args.seq]
    cap = args.cap_mib * 2**20 if args.cap_mib is not None else base["saved_bytes"]
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "model": MODEL, "mode": "ring", "sequence": args.seq, "cap_mib": round(cap / 2**20, 2), "by_cp": {}, "targets": {},
    }
    for cp, rows in results.items():
        fits = [seq for seq, row in rows.items() if row["saved_bytes"] <= cap]
        row = rows[args.seq]
        report["by_cp"][cp] = {
            "activation_mib_per_rank": round(row["saved_bytes"] / 2**20, 2),
            "activation_vs_cp1": round(row["saved_bytes"] / base["saved_bytes"], 4),
            "activation_vs_cp1_over_ideal": round(row["saved_bytes"] / base["saved_bytes"] * cp, 4),
            "tokens_per_s": round(args.seq / row["step_s"], 1),
            "speed_vs_cp1": round(base["step_s"] / row["step_s"], 3),
            "longest_sequence_under_cap": max(fits) if fits else None,
            "by_sequence": {seq: {"activation_mib": round(r["saved_bytes"] / 2**20, 2), "step_s": round(r["step_s"], 4)}
                            for seq, r in rows.items()},
        }
    report["targets"] = {
        "activation_per_rank_le_1.1_over_cp": all(v["activation_vs_cp1_over_ideal"] <= 1.1 for v in report["by_cp"].values()),
        "longest_sequence_cp4_vs_cp1": (report["by_cp"][4]["longest_sequence_under_cap"] or 0)
        / max(report["by_cp"][1]["longest_sequence_under_cap"] or 1, 1),
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("by_cp", "targets")}, indent=2))


if __name__ == "__main__":
    main()
