"""Per-rank peak memory of a training step, measured: what the planner's predictions are checked against.

On a GPU this is the caching allocator's peak (``torch.cuda.max_memory_allocated``). On a CPU there is no
allocator to ask, and the resident set size keeps pages glibc has not returned, so the host's bytes in use
(glibc ``mallinfo2``: heap in use plus mmapped blocks) are sampled after every dispatched op, and the
bytes in use before the model was built are subtracted.

Those bytes also grow by about 1 KB per collective until torch's record of recent collectives (2000 entries)
is full, about 2 MiB later (measured on gloo, torch 2.13: a tensor-parallel run's host bytes grow for ~90 steps,
then stay flat). It is bounded, not a leak; a three-step measurement includes part of it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar.data import ordered_loader
from lightning_llmpar.planner.candidate import Candidate
from lightning_llmpar.training.steps import ends_a_step

__all__ = ["HostMemoryPeak", "MeasuredPeak", "StepTimes", "host_bytes_in_use", "measure_layout"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
    )]


_LIBC: Any = None


def host_bytes_in_use() -> int:
    """Bytes this process holds from glibc's allocator (all arenas, mmapped blocks included)."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
        _LIBC.mallinfo2.restype = _MallInfo2
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class HostMemoryPeak(TorchDispatchMode):
    """The largest ``host_bytes_in_use`` seen after any op while active."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = host_bytes_in_use()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, host_bytes_in_use())
        return out


class MeasuredPeak(Callback):
    """Peak bytes of every training step above the bytes in use when the callback was made.

    Make it before the LightningModule, so the model's own parameters count. ``peaks`` holds one figure per
    training step (the optimizer step included); the planner predicts the steady state, the largest of them.
    """

    def __init__(self) -> None:
        gc.collect()  # what earlier runs left for the collector would otherwise be freed during this one
        self.baseline = host_bytes_in_use()
        self.peaks: list[int] = []
        self._mode: HostMemoryPeak | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
            return
        self._mode = HostMemoryPeak()
        self._mode.__enter__()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if pl_module.device.type == "cuda":
            self.peaks.append(torch.cuda.max_memory_allocated(pl_module.device))
            return
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        self.peaks.append(self._mode.peak - self.baseline)
        self._mode = None


class _Tokens(LightningDataModule):
    """Random token windows read in order: rank r of the data-parallel group takes samples r, r+dp, ..."""

    def __init__(self, batch_size: int, seq: int, vocab: int, steps: int) -> None:
        super().__init__()
        tokens = torch.randint(0, vocab, (batch_size * steps * 64, seq + 1), generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return ordered_loader(self.data, self.batch_size, self.trainer.strategy)


class StepTimes(Callback):
    """Wall-clock seconds of every optimizer step (all its accumulated batches), after a barrier."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start: float | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._start is None:
            trainer.strategy.barrier()
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if not ends_a_step(trainer):
            return
        self.seconds.append(time.perf_counter() - self._start)  # type: ignore[operator]
        self._start = None


def measure_layout(
    candidate: Candidate, model: dict[str, Any], seq: int, steps: int = 3, what: str = "memory",
    precision: str = "32-true",
) -> Any:
    """Train the example GPT (``model``: its arguments) under ``candidate`` on this rank for ``steps`` optimizer
    steps; return this rank's peak bytes over them (``what="memory"``), or each step's seconds (``"time"``, no
    sampling then). ``precision``: "32-true" or "bf16-mixed" (``BF16Precision``, CPU autocast). Call it on every
    rank (torchrun or similar)."""
    from lightning_llmpar.activation_checkpointing import ActivationCheckpointing
    from lightning_llmpar.models import GPTModule
    from lightning_llmpar.planner.config import strategy_args
    from lightning_llmpar.precision.plugins import BF16Precision
    from lightning_llmpar.strategies.llm_parallel import LLMParallelStrategy

    probe: MeasuredPeak | StepTimes = MeasuredPeak() if what == "memory" else StepTimes()  # before the model
    seed_everything(0, verbose=False)
    module = GPTModule(block_size=seq, **model)
    callbacks: list[Callback] = [probe]
    if candidate.checkpointing != "none":
        callbacks.append(ActivationCheckpointing(mode=candidate.checkpointing))
    pipelined = candidate.pp > 1
    trainer = Trainer(
        accelerator="cpu", devices=candidate.world_size, strategy=LLMParallelStrategy(**strategy_args(candidate)),
        max_steps=steps, accumulate_grad_batches=1 if pipelined else candidate.microbatches, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=callbacks, use_distributed_sampler=False,
        plugins=[BF16Precision(device="cpu")] if precision == "bf16-mixed" else None,
    )
    batch = candidate.micro_batch * (candidate.microbatches if pipelined else 1)
    trainer.fit(module, datamodule=_Tokens(batch, seq, model.get("vocab_size", 256), steps))
    del trainer, module
    return max(probe.peaks) if isinstance(probe, MeasuredPeak) else probe.seconds
