"""Pipeline benchmark: measured bubble vs theory, and throughput against one process and a plain loop.

Run from the repository root:  python -m benchmarks.pipeline_bench [--quick]
Writes benchmarks/results/pipeline.json. All figures come from one run, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.callbacks.timeline import PipelineTimeline
from lightning_llmpar.data import ordered_loader
from lightning_llmpar.launch import run_ranks
from lightning_llmpar.models import GPTModule
from lightning_llmpar.models.gpt import GPT
from lightning_llmpar.pipeline.stages import plan_stages

OUT = Path(__file__).parent / "results" / "pipeline.json"
MODEL = dict(vocab_size=256, block_size=128, n_layer=8, n_head=4, n_kv_head=2, n_embd=256)
MB_SIZE = 16  # samples per microbatch (fixed across runs): large enough that compute dwarfs p2p latency


class _Data(LightningDataModule):
    def __init__(self, batch: int, n: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, MODEL["vocab_size"], (n, MODEL["block_size"] + 1), generator=g)
        self.data, self.batch = TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch

    def train_dataloader(self) -> DataLoader:
        return ordered_loader(self.data, self.batch, self.trainer.strategy, drop_last=True)


class _Clock(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.bubbles: list[float] = []

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)
        runner = getattr(trainer.strategy, "pipeline_runner", None)
        if runner is not None:
            self.bubbles.append(runner.bubble_fraction())


def lightning_run(
    strategy_kwargs: dict[str, Any] | None, microbatches: int, steps: int, picture: bool = False
) -> dict[str, Any]:
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    module = GPTModule(**MODEL)
    clock = _Clock()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    strategy: Any = "auto" if strategy_kwargs is None else LLMParallelStrategy(**strategy_kwargs)
    batch = MB_SIZE * microbatches
    callbacks: list[Callback] = [clock]
    if picture:  # the timeline of the last step, written to benchmarks/results
        callbacks.append(PipelineTimeline(every_n_steps=steps, picture_at_step=steps))
    trainer = Trainer(accelerator="cpu", devices=world if strategy_kwargs else 1, strategy=strategy, max_steps=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=OUT.parent,
                      enable_model_summary=False, limit_val_batches=0, callbacks=callbacks, use_distributed_sampler=False)
    trainer.fit(module, datamodule=_Data(batch, batch * (steps + 1)))
    return {"step_s": clock.times, "bubble": clock.bubbles, "tokens_per_step": batch * MODEL["block_size"]}


class _PlainStage(nn.Module):
    """A stage written by hand for torch.distributed.pipelining, as one would without this package."""

    def __init__(self, gpt: GPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_emb = gpt.tok_emb if first else None
        self.layers = nn.ModuleList(gpt.layers[i] for i in blocks)
        self.norm = gpt.norm if last else None
        self.lm_head = gpt.lm_head if last else None
        self.register_buffer("cos", gpt.rope_cos, persistent=False)
        self.register_buffer("sin", gpt.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = self.tok_emb(x)
        cos, sin = self.cos[: x.shape[1]], self.sin[: x.shape[1]]
        for layer in self.layers:
            x = layer(x, cos, sin)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def plain_loop(microbatches: int, steps: int, schedule: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from lightning_llmpar.models.gpt import GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**MODEL))
    cls = get_schedule_class(schedule)
    per_rank = 1 if issubclass(cls, PipelineScheduleSingle) else 2
    num_stages = pp * per_rank
    costs = [sum(p.numel() for p in b.parameters()) for b in gpt.layers]
    ranges = plan_stages(costs, num_stages, first_extra=gpt.tok_emb.weight.numel(),
                         last_extra=gpt.lm_head.weight.numel() + gpt.norm.weight.numel())
    local = [s for s in range(num_stages) if s % pp == rank]
    modules = [_PlainStage(gpt, range(*ranges[s]), s == 0, s == num_stages - 1) for s in local]
    stages = [PipelineStage(m, s, num_stages, torch.device("cpu")) for m, s in zip(modules, local)]

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    sched = cls(stages[0] if per_rank == 1 else stages, microbatches, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95))
    batch = MB_SIZE * microbatches
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, MODEL["vocab_size"], (batch, MODEL["block_size"] + 1), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        if rank == 0:
            sched.step(tokens[:, :-1], target=tokens[:, 1:])
        else:
            sched.step(target=tokens[:, 1:])
        opt.step()
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {"step_s": times, "tokens_per_step": batch * MODEL["block_size"]}


def _steady(times: list[float], skip: int = 2) -> float:
    kept = times[skip:] or times
    return sum(kept) / len(kept)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer steps (for a smoke run)")
    args = parser.parse_args()
    steps = 4 if args.quick else 6
    pp = 2
    results: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                               "torch": torch.__version__, "model": MODEL, "microbatch_size": MB_SIZE, "pp": pp}
    bubbles = []
    for m in (4, 8, 16):
        for schedule in ("GPipe", "1F1B", "Interleaved1F1B"):
            kw = {"pipeline_parallel": pp, "pipeline_schedule": schedule, "pipeline_microbatches": m}
            outs = run_ranks(lightning_run, pp, kw, m, steps, timeout=1800)
            v = 2 if schedule == "Interleaved1F1B" else 1
            theory = (pp - 1) / (v * m + pp - 1)
            measured = sum(sum(o["bubble"][2:]) / len(o["bubble"][2:]) for o in outs) / len(outs)
            row = {"schedule": schedule, "microbatches": m, "virtual_stages": v, "measured_bubble": round(measured, 4),
                   "theory_bubble": round(theory, 4), "ratio_to_theory": round(measured / theory, 3)}
            bubbles.append(row)
            print(json.dumps(row), flush=True)
    results["bubble"] = bubbles

    m = 8
    one = run_ranks(lightning_run, 1, None, m, steps, timeout=1800)[0]
    ours = run_ranks(lightning_run, pp, {"pipeline_parallel": pp, "pipeline_microbatches": m}, m, steps, True, timeout=1800)
    plain = run_ranks(plain_loop, pp, m, steps, "Interleaved1F1B", timeout=1800)
    tps = lambda r: r["tokens_per_step"] / _steady(r["step_s"])  # noqa: E731
    t_one, t_ours, t_plain = tps(one), min(tps(o) for o in ours), min(tps(o) for o in plain)
    results["throughput"] = {
        "schedule": "Interleaved1F1B", "microbatches": m,
        "tokens_per_s_one_process": round(t_one, 1),
        "tokens_per_s_pp2_lightning_llmpar": round(t_ours, 1),
        "tokens_per_s_pp2_plain_pipelining_loop": round(t_plain, 1),
        "speedup_pp2_vs_one_process": round(t_ours / t_one, 3),
        "scaling_efficiency_pp2": round(t_ours / (pp * t_one), 3),
        "ratio_to_plain_loop": round(t_ours / t_plain, 3),
        "timeline_picture": str((OUT.parent / f"pipeline_timeline_step{steps}.png").relative_to(Path.cwd())),
    }
    print(json.dumps(results["throughput"]), flush=True)
    interleaved = {r["microbatches"]: r["measured_bubble"] for r in bubbles if r["schedule"] == "Interleaved1F1B"}
    one_f1b = {r["microbatches"]: r["measured_bubble"] for r in bubbles if r["schedule"] == "1F1B"}
    results["checks"] = {
        "interleaved_below_1f1b_at_every_m": all(interleaved[k] < one_f1b[k] for k in interleaved),
        "every_bubble_within_1.25x_of_theory": all(r["ratio_to_theory"] <= 1.25 for r in bubbles),
        "lightning_at_least_0.95x_plain_loop": results["throughput"]["ratio_to_plain_loop"] >= 0.95,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2))
    print(json.dumps(results["checks"]), f"-> {OUT}")


if __name__ == "__main__":
    main()
