"""Context and expert parallelism, measured.

Context parallelism (example GPT, ring attention): activation bytes per rank for one sequence at cp1/2/4, the
longest sequence that fits a per-rank activation cap, and tokens per second at equal global tokens. Activation
bytes are what autograd saves for backward during the first training step's forward (each storage counted once,
parameters left out), on every rank; the figure per layout is the largest rank's.

Expert parallelism (example GPT with 8 experts, top-2): on 4 data-parallel ranks at equal global tokens, experts
replicated (ep1) vs split over 2 and 4 ranks: tokens per second and expert-parameter bytes per rank.

Run from the repository root:  python -m benchmarks.cp_ep_bench [--part cp|ep|both] [--seq 2048] [--steps 3]
Writes benchmarks/results/cp_ep.json (a part run alone keeps the other part's figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.data import ordered_loader
from lightning_llmpar.launch import run_ranks
from lightning_llmpar.models import GPTModule

OUT = Path(__file__).parent / "results" / "cp_ep.json"
MODEL = dict(vocab_size=256, n_layer=4, n_head=4, n_kv_head=2, n_embd=128)
SEQS = (1024, 2048, 4096, 8192)


class _Tokens(LightningDataModule):
    """``batch`` random sequences per step and data-parallel rank (context-parallel ranks read the same)."""

    def __init__(self, seq: int, steps: int, batch: int = 1) -> None:
        super().__init__()
        self.seq, self.steps, self.batch = seq, steps, batch

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, MODEL["vocab_size"], (self.steps * self.batch, self.seq + 1), generator=g)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        return ordered_loader(data, self.batch, self.trainer.strategy)


class _Measure(Callback):
    """Saved-for-backward bytes of the first step's forward, and each step's wall time."""

    def __init__(self, saved: bool = True) -> None:
        self.saved = saved
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
        if idx == 0 and self.saved:
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


def _fit(strategy: Any, devices: int, measure: _Measure, module: Any, data: Any, steps: int) -> None:
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, callbacks=[measure], limit_val_batches=0)
    trainer.fit(module, datamodule=data)


def _each(items: list[Any]) -> Iterator[Any]:
    """Each item of a launch's runs, after putting back the launch variables (Lightning's teardown removes some)
    and the seed."""
    env = dict(os.environ)
    for item in items:
        os.environ.update(env)
        seed_everything(0, verbose=False)
        yield item


def _run(seqs: list[int], steps: int) -> list[dict[str, Any]]:
    """On each rank of one launch (its size is the cp degree): a short run per sequence length."""
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    rows = []
    for seq in _each(seqs):
        measure = _Measure()
        strategy: Any = "auto" if cp == 1 else LLMParallelStrategy(context_parallel=cp)
        _fit(strategy, cp, measure, GPTModule(**MODEL, block_size=seq, learning_rate=1e-3, warmup_steps=1,
                                              total_steps=steps), _Tokens(seq, steps), steps)
        rows.append({"seq": seq, "saved_bytes": measure.saved_bytes, "step_s": statistics.median(measure.times[1:])})
    return rows


MOE = dict(MODEL, n_expert=8, n_expert_per_token=2)


def _run_ep(eps: list[int], seq: int, batch: int, steps: int) -> list[dict[str, Any]]:
    """On each of the 4 ranks of one launch: a short run per expert-parallel degree (1 = experts replicated)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows = []
    for ep in _each(eps):
        measure = _Measure(saved=False)
        module = GPTModule(**MOE, block_size=seq, learning_rate=1e-3, warmup_steps=1, total_steps=steps)
        _fit(LLMParallelStrategy(expert_parallel=ep), world, measure, module, _Tokens(seq, steps * world, batch), steps)

        def local_bytes(params: Any) -> int:
            return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in params)

        experts = [p for name, p in module.named_parameters() if ".experts." in name]
        rows.append({"ep": ep, "step_s": statistics.median(measure.times[1:]), "expert_bytes": local_bytes(experts),
                     "param_bytes": local_bytes(module.parameters())})
    return rows


def ep_report(seq: int, batch: int, steps: int) -> dict[str, Any]:
    world, eps = 4, [1, 2, 4]
    per_rank = run_ranks(_run_ep, world, eps=eps, seq=seq, batch=batch, steps=steps, timeout=1800)
    rows = {row["ep"]: {"step_s": max(r[i]["step_s"] for r in per_rank),
                        "expert_bytes": max(r[i]["expert_bytes"] for r in per_rank),
                        "param_bytes": max(r[i]["param_bytes"] for r in per_rank)} for i, row in enumerate(per_rank[0])}
    base, tokens = rows[1], world * batch * seq
    return {
        "model": MOE, "ranks": world, "sequence": seq, "batch_per_rank": batch, "global_tokens_per_step": tokens,
        "by_ep": {ep: {"tokens_per_s": round(tokens / r["step_s"], 1), "speed_vs_replicated": round(base["step_s"] / r["step_s"], 3),
                       "expert_mib_per_rank": round(r["expert_bytes"] / 2**20, 3),
                       "expert_bytes_vs_replicated": round(r["expert_bytes"] / base["expert_bytes"], 4),
                       "param_mib_per_rank": round(r["param_bytes"] / 2**20, 3)} for ep, r in rows.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048, help="the sequence for the bytes and speed comparison")
    parser.add_argument("--cap-mib", type=float, default=None,
                        help="per-rank activation cap for the longest sequence (default: what cp1 saves at --seq)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--part", choices=("cp", "ep", "both"), default="both")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict[str, Any] = json.loads(OUT.read_text()) if OUT.exists() else {}
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}
    if args.part in ("cp", "both"):
        report.update(cp_report(args.seq, args.cap_mib, args.steps))
    if args.part in ("ep", "both"):
        report["expert_parallel"] = ep_report(seq=256, batch=4, steps=max(args.steps, 10))
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("by_cp", "targets", "expert_parallel") if k in report}, indent=2))


def cp_report(seq: int, cap_mib: float | None, steps: int) -> dict[str, Any]:
    results: dict[int, dict[int, dict[str, float]]] = {}
    for cp in (1, 2, 4):
        per_rank = run_ranks(_run, cp, seqs=list(SEQS), steps=steps, timeout=1800)
        results[cp] = {row["seq"]: {"saved_bytes": max(r[i]["saved_bytes"] for r in per_rank),
                                    "step_s": max(r[i]["step_s"] for r in per_rank)}
                       for i, row in enumerate(per_rank[0])}
    base = results[1][seq]
    cap = cap_mib * 2**20 if cap_mib is not None else base["saved_bytes"]
    report: dict[str, Any] = {"model": MODEL, "mode": "ring", "sequence": seq, "cap_mib": round(cap / 2**20, 2),
                              "by_cp": {}, "targets": {}}
    for cp, rows in results.items():
        fits = [s for s, row in rows.items() if row["saved_bytes"] <= cap]
        row = rows[seq]
        report["by_cp"][cp] = {
            "activation_mib_per_rank": round(row["saved_bytes"] / 2**20, 2),
            "activation_vs_cp1": round(row["saved_bytes"] / base["saved_bytes"], 4),
            "activation_vs_cp1_over_ideal": round(row["saved_bytes"] / base["saved_bytes"] * cp, 4),
            "tokens_per_s": round(seq / row["step_s"], 1),
            "speed_vs_cp1": round(base["step_s"] / row["step_s"], 3),
            "longest_sequence_under_cap": max(fits) if fits else None,
            "by_sequence": {s: {"activation_mib": round(r["saved_bytes"] / 2**20, 2), "step_s": round(r["step_s"], 4)}
                            for s, r in rows.items()},
        }
    report["targets"] = {
        "activation_per_rank_le_1.1_over_cp": all(v["activation_vs_cp1_over_ideal"] <= 1.1 for v in report["by_cp"].values()),
        "longest_sequence_cp4_vs_cp1": (report["by_cp"][4]["longest_sequence_under_cap"] or 0)
        / max(report["by_cp"][1]["longest_sequence_under_cap"] or 1, 1),
    }
    return report


if __name__ == "__main__":
    main()
