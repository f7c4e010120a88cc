"""Run metrics that stay right under parallelism: tokens/s over data-parallel ranks, memory per rank."""

from __future__ import annotations

import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["ThroughputAndMemory"]


def _rank_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Peak resident set size of this process (KiB on Linux).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class ThroughputAndMemory(Callback):
    """Log ``perf/tokens_per_sec`` (whole run) and ``memory/rank{r}_mb`` every ``log_every_n_steps``
    optimizer steps (default: the Trainer's ``log_every_n_steps``).

    Lightning's ThroughputMonitor multiplies per-device numbers by the world size, which over-counts
    under tensor parallelism (those ranks share one batch). Here tokens are counted on one rank of each
    data-parallel group and multiplied by the data-parallel degree only.
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        self.every = log_every_n_steps
        self._tokens = 0
        self._start: float | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        self._tokens += int(inputs.numel())
        # Only right after an optimizer step, and every `log_every_n_steps` of them.
        every = self.every or trainer.log_every_n_steps
        if (batch_idx + 1) % trainer.accumulate_grad_batches or trainer.global_step % every:
            return
        assert self._start is not None
        elapsed = time.perf_counter() - self._start
        dp = trainer.strategy.distributed_sampler_kwargs.get("num_replicas", 1) if trainer.world_size > 1 else 1
        pl_module.log("perf/tokens_per_sec", self._tokens * dp / max(elapsed, 1e-9), rank_zero_only=True)
        memory = torch.tensor([_rank_memory_mb(pl_module.device)], device=pl_module.device)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            gathered = [torch.zeros_like(memory) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, memory)
        else:
            gathered = [memory]
        for rank, value in enumerate(gathered):
            pl_module.log(f"memory/rank{rank}_mb", float(value), rank_zero_only=True)
