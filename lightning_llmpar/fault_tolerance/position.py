"""The data position in every checkpoint: a run resumed mid-epoch goes on with the epoch's remaining samples.

Lightning restarts a resumed epoch's data from its beginning. With a ``ResumableDistributedSampler`` as the training
loader's sampler, ``DataPosition`` counts the samples trained on this epoch (over all data-parallel ranks), saves the
count with each checkpoint, and starts the sampler after them on resume. ``FaultTolerantCheckpoint`` does the same
for its own checkpoints; the two together count each batch once.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_llmpar.fault_tolerance.sampler import ResumableDistributedSampler
from lightning_llmpar.training.batches import batch_size

__all__ = ["DataPosition", "count_batch", "resumable_sampler", "restore_position"]


def resumable_sampler(trainer: Trainer) -> ResumableDistributedSampler | None:
    """The training loader's ``ResumableDistributedSampler``, if it has one; refused when Lightning wrapped it."""
    loader = trainer.train_dataloader
    for candidate in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(candidate, ResumableDistributedSampler):
            return candidate
        inner = getattr(getattr(candidate, "dataset", None), "_sampler", None)  # Lightning's wrapper
        if isinstance(inner, ResumableDistributedSampler):
            raise ValueError(
                "The ResumableDistributedSampler was wrapped in another distributed sampler, so each rank would see"
                " a share of its share and its position would not be saved. Pass it to the DataLoader as `sampler`"
                " directly (Lightning then keeps it) and do not wrap it."
            )
    return None


# Lightning warns, as the resumed epoch starts (after ``on_train_start``), that a mid-epoch resume of a loader it
# cannot restore is unreliable. Once the sampler was started after the saved position the resume is exact, so the
# warning is silenced from then until the first trained batch.
_LIGHTNING_RESUME_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended"


def _silence_resume_warning(silence: bool) -> None:
    ours = [f for f in warnings.filters if f[0] == "ignore" and getattr(f[1], "pattern", None) == _LIGHTNING_RESUME_WARNING]
    if silence and not ours:
        warnings.filterwarnings("ignore", message=_LIGHTNING_RESUME_WARNING)
    elif not silence:
        for f in ours:
            warnings.filters.remove(f)


def count_batch(trainer: Trainer, batch: Any, batch_idx: int) -> None:
    """Add a trained batch to the sampler's position, once however many callbacks report it."""
    _silence_resume_warning(False)
    _count(trainer, batch_size(batch), batch_idx)


def _count(trainer: Trainer, samples_per_rank: int, batch_idx: int) -> None:
    sampler = resumable_sampler(trainer)
    if sampler is not None:
        sampler.advance(samples_per_rank, (trainer.current_epoch, batch_idx))


def restore_position(trainer: Trainer, position: dict[str, int] | None) -> None:
    """Check the sampler against the layout, then start it at a saved ``position`` of the current epoch.

    Lightning resumes a started epoch without calling ``on_train_epoch_start``, so this runs at ``on_train_start``,
    before the resumed run draws its first batch."""
    sampler = resumable_sampler(trainer)
    # Any strategy that deals data says how (replica groups on torchft do so with one rank per group too).
    expected = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    if sampler is not None and (sampler.num_replicas, sampler.rank) != (expected["num_replicas"], expected["rank"]):
        raise ValueError(
            f"ResumableDistributedSampler(num_replicas={sampler.num_replicas}, rank={sampler.rank}) does not match the"
            f" data-parallel layout (num_replicas={expected['num_replicas']}, rank={expected['rank']}): ranks would see"
            " the wrong share of the data. Build it with trainer.strategy.distributed_sampler_kwargs."
        )
    if sampler is not None and position is not None and position["epoch"] == trainer.current_epoch:
        sampler.load_state_dict(position)
        _silence_resume_warning(True)


class DataPosition(Callback):
    """Saves a ``ResumableDistributedSampler``'s position with every checkpoint, whichever callback writes it, and
    restores it on resume (`llmpar fit` adds it; nothing happens without such a sampler)."""

    def __init__(self) -> None:
        self._trainer: Trainer | None = None
        self._position: dict[str, int] | None = None
        self._current: tuple[int, int] | None = None  # (samples per rank, index) of the batch being trained

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        restore_position(trainer, self._position)
        self._position = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, idx: int) -> None:
        self._current = (batch_size(batch), idx)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int) -> None:
        count_batch(trainer, batch, idx)

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        sampler = resumable_sampler(trainer) if trainer is not None else None
        if sampler is None:
            return {}
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        if self._current is not None and progress.processed > progress.completed:
            # Saved from another callback's on_train_batch_end that runs before this one's: the batch is trained.
            _count(trainer, *self._current)
        return {"data_position": sampler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._position = state_dict.get("data_position")
