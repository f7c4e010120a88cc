"""A fire drill for the restart path: a small training run (the example GPT, dp2 ZeRO-3 by default, checkpoints
every 3 steps) that kills one of its ranks on purpose at a step or while a checkpoint is written, and records
which samples each step trained on, so a restarted run can be compared with an uninterrupted one. The fault
tests and ``benchmarks/fault_bench.py`` run it; on a cluster it rehearses a job's restarts:

    torchrun --nproc-per-node 2 --max-restarts 3 -m lightning_llmpar.fault_tolerance.drill --out DIR --kill-at 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import LightningDataModule, Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.callbacks.throughput import ThroughputAndMemory
from lightning_llmpar.checkpointing import dcp as checkpoint
from lightning_llmpar.fault_tolerance.callbacks import FaultTolerantCheckpoint, StepGuard
from lightning_llmpar.fault_tolerance.sampler import ResumableDistributedSampler
from lightning_llmpar.launch import run_ranks
from lightning_llmpar.models import GPTModule

__all__ = ["DrillData", "DrillModule", "STEPS", "committed_samples", "run_until_done", "train"]

VOCAB, SEQ, SAMPLES = 64, 16, 64
STEPS = 12


class _Tokens(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
        self.dict_batches = False

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> Any:
        if self.dict_batches:
            return {"input_ids": self.tokens[i, :-1], "targets": self.tokens[i, 1:], "ids": i}
        return self.tokens[i, :-1], self.tokens[i, 1:], i


class DrillData(LightningDataModule):
    def __init__(self, dict_batches: bool = False) -> None:
        super().__init__()
        self.dict_batches = dict_batches

    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        data = _Tokens()
        data.dict_batches = self.dict_batches
        sampler = ResumableDistributedSampler(data, shuffle=True, seed=7, **kwargs)
        return DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)


class DrillModule(GPTModule):
    def __init__(self, out: Path, kill_at: int, preempt: tuple[float, ...] = (),
                 signum: int = int(signal.SIGTERM)) -> None:
        super().__init__(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_kv_head=2, n_embd=32,
                         learning_rate=1e-2, warmup_steps=2, total_steps=40)
        self.out, self.kill_at = out, kill_at
        # (step, delay of rank 0's SIGTERM, of rank 1's...): a preemption notice reaching the ranks at moments
        # apart, on a timer, so it lands wherever that rank is (a delay < 0: that rank gets none; a step < 0: at
        # the module's on_train_start, after the callbacks' and before the first step).
        self.preempt, self.signum = preempt, signum

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = (batch["input_ids"], batch["targets"], batch["ids"]) if isinstance(batch, dict) else batch
        step, rank = self.trainer.global_step, self.trainer.global_rank
        if getattr(self.trainer.strategy, "checking_pipeline_split", False):
            return super().training_step((x, y), batch_idx)  # the split check's extra run: not a step
        with open(self.out / f"seen_rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "epoch": self.trainer.current_epoch, "ids": ids.tolist()}) + "\n")
        if step == self.kill_at and rank == 1 and _first_time(self.out / "killed"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.preempt and step == self.preempt[0]:
            self._preempt()
        return super().training_step((x, y), batch_idx)

    def on_train_start(self) -> None:
        if self.preempt and self.preempt[0] < 0:  # before the first step
            self._preempt()

    def _preempt(self) -> None:
        rank = self.trainer.global_rank
        if self.preempt[1 + rank] >= 0 and _first_time(self.out / f"preempted{rank}"):
            threading.Timer(self.preempt[1 + rank], os.kill, (os.getpid(), self.signum)).start()


def _first_time(marker: Path) -> bool:
    try:
        marker.touch(exist_ok=False)
        return True
    except FileExistsError:
        return False


def _kill_while_saving(out: Path) -> None:
    # Die after the shards are written but before the checkpoint is complete (meta.pt, rename).
    original = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if str(f).endswith(checkpoint.META_FILE) and _first_time(out / "killed"):
            os.kill(os.getpid(), signal.SIGKILL)
        original(obj, f, *args, **kwargs)

    checkpoint.torch.save = save  # type: ignore[attr-defined]


def train(out: Path, steps: int = 12, kill_at: int = -1, kill_in_save: bool = False,
          strategy: dict[str, Any] | None = None, timeout_s: float = 1800, save_every: int = 3,
          dict_batches: bool = False, preempt: tuple[float, ...] = (), requeue: bool = False) -> int:
    """Train to ``steps`` from the newest intact checkpoint in ``out/ckpt`` (if any); returns the final step.
    ``dict_batches``: dict batches, Lightning's own distributed-sampler setting and a throughput callback;
    ``preempt``: a SIGTERM to each rank at a step (see DrillModule); ``requeue``: under SLURM (or its variables),
    with ``SLURMEnvironment(auto_requeue=True)``: ``preempt`` sends SLURM's requeue signal instead, and the run
    resumes as Lightning does after a requeue, from the newest ``hpc_ckpt_N.ckpt`` in ``out`` if there is one."""
    from datetime import timedelta

    torch.set_num_threads(1)
    if kill_in_save:
        _kill_while_saving(out)
    seed_everything(0, verbose=False)
    slurm = SLURMEnvironment(auto_requeue=True) if requeue else None
    # The signal as a plain int: the module's hyperparameters go into its checkpoints, read by torch's safe loader.
    module = DrillModule(out, kill_at, preempt, int(slurm.requeue_signal if slurm else signal.SIGTERM))
    trainer = Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=LLMParallelStrategy(**(strategy or {"zero_stage": 3}), timeout=timedelta(seconds=timeout_s)),
        max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, use_distributed_sampler=dict_batches, default_root_dir=out, plugins=slurm and [slurm],
        callbacks=[FaultTolerantCheckpoint(str(out / "ckpt"), every_n_train_steps=save_every, keep_last=2), StepGuard(),
                   *([ThroughputAndMemory(log_every_n_steps=2)] if dict_batches else [])],
    )
    trainer.fit(module, datamodule=DrillData(dict_batches), ckpt_path=None if requeue else "last")
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for n, p in module.named_parameters()}
    if trainer.global_rank == 0:
        torch.save(weights, out / "final.pt")
    return trainer.global_step


def run_until_done(
    out: Path, kill_at: int = -1, in_save: bool = False, restarts: int = 3, strategy: dict[str, Any] | None = None,
    dict_batches: bool = False, steps: int = STEPS, save_every: int = 3,
) -> int:
    """Launch 2 ranks; when a rank dies, start the job again (as a requeue or torchrun restart would).

    The process-group timeout is short, so the surviving rank stops instead of waiting for its peer.
    Returns how many launches failed.
    """
    out.mkdir(parents=True, exist_ok=True)
    for attempt in range(restarts + 1):
        try:
            run_ranks(train, 2, out, steps, kill_at, in_save, strategy, 60.0, save_every, dict_batches, timeout=240)
            return attempt
        except RuntimeError:
            continue
    raise AssertionError(f"the run did not finish within {restarts} restarts")


def committed_samples(out: Path) -> dict[tuple[int, int], list[int]]:
    """(rank, step) -> sample ids of the step that counted: a step replayed after a restart overwrites."""
    seen: dict[tuple[int, int], list[int]] = {}
    for rank in (0, 1):
        for line in (out / f"seen_rank{rank}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            seen[(rank, rec["step"])] = rec["ids"]
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-in-save", action="store_true")
    parser.add_argument("--strategy", type=json.loads, default={"zero_stage": 3})
    args = parser.parse_args()
    train(args.out, args.steps, args.kill_at, args.kill_in_save, args.strategy)


if __name__ == "__main__":
    main()
