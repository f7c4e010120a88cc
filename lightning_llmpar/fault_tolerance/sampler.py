"""A distributed sampler whose position is part of the checkpoint: a resumed epoch sees each sample once."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["ResumableDataLoader", "ResumableDistributedSampler"]


class ResumableDistributedSampler(DistributedSampler):
    """Shuffles the whole dataset per epoch (seed + epoch), deals it to data-parallel ranks, and can start
    after the first ``consumed`` samples of the epoch (counted over all ranks).

    The consumed samples are a prefix of the epoch's global order, so resuming deals out exactly the
    rest, also under a different number of data-parallel ranks. Build it with the strategy's
    ``distributed_sampler_kwargs``; being a ``DistributedSampler``, Lightning keeps it as it is (whatever
    ``use_distributed_sampler`` says) and sets its epoch. The ``FaultTolerantCheckpoint`` callback saves and
    restores its position.
    """

    def __init__(self, dataset: Sized, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0) -> None:
        for name, value in (("num_replicas", num_replicas), ("rank", rank), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"ResumableDistributedSampler: `{name}` must be an integer, got {value!r}.")
        if num_replicas < 1 or not isinstance(shuffle, bool):
            raise ValueError(
                f"ResumableDistributedSampler: num_replicas={num_replicas!r} must be >= 1 and shuffle={shuffle!r}"
                " True or False."
            )
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, num_replicas={num_replicas}).")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.consumed = 0  # samples of this epoch already trained on, over all ranks
        self._advanced_at: Any = None  # the batch last counted (several callbacks may report one batch)
        self.total = (len(dataset) // num_replicas) * num_replicas  # equal share per rank, like drop_last
        # DistributedSampler's own fields, for code that reads them.
        self.drop_last, self.total_size, self.num_samples = True, self.total, self.total // num_replicas

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.consumed = 0
        self.epoch = epoch

    def advance(self, samples_per_rank: int, batch: Any) -> None:
        """Count a trained batch of ``samples_per_rank`` on every rank into the position, once per ``batch`` key."""
        if batch != self._advanced_at:
            self.consumed += samples_per_rank * self.num_replicas
            self._advanced_at = batch

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.total))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=g)[: self.total].tolist()

    def __iter__(self) -> Iterator[int]:
        # A generator: the position is read when the first index is drawn, not when the loader is built.
        rest = self.order()[self.consumed :]
        yield from rest[self.rank :: self.num_replicas]

    def __len__(self) -> int:
        return (self.total - self.consumed) // self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.consumed, self.seed = state["epoch"], state["consumed"], state["seed"]


class ResumableDataLoader(DataLoader):
    """A DataLoader over a ``ResumableDistributedSampler`` whose position Lightning keeps with its loop state (a
    stateful loader) and gives back before the loader's iterator exists: a loader with workers draws its first
    indices when the iterator is made, before any callback could move the sampler. ``trainer`` (whose epoch the
    restore follows) is the one the loader is built for; a position of another epoch starts that epoch afresh."""

    def __init__(self, *args: Any, trainer: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        # Another sampler (Lightning swaps in a sequential one for overfit_batches) has no position.
        return self.sampler.state_dict() if isinstance(self.sampler, ResumableDistributedSampler) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state or not isinstance(self.sampler, ResumableDistributedSampler):
            return
        epoch = getattr(self._trainer, "current_epoch", state["epoch"])
        if state["epoch"] == epoch:
            self.sampler.load_state_dict(state)
        else:  # the saved epoch was finished: this one starts at its beginning, in its own order
            self.sampler.set_epoch(epoch)
