"""Streams that give the ranks different numbers of batches stop together, at the shortest.

Lightning's samplers give every data-parallel rank as many batches as the others, but a dataset that shards itself
(an ``IterableDataset``, a stream per process) need not: the rank whose part ends first left its loop while the
others went on into their next collective (a parameter all-gather under ZeRO-3, a gradient all-reduce, a pipeline
stage's send) and waited for it forever, a hang on GPUs until the process group's timeout. Each batch such a loader
yields is now agreed on by every rank first (one all-reduce of two integers on a CPU group, so no device is
synchronized): when one rank has run out, every rank ends the epoch there, and rank zero says how many batches
were trained and that the ranks with more left theirs out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from lightning_llmpar.layout import reuse_groups

__all__ = ["even_out_streams"]

_LOCKSTEP_CLASSES: dict[type, type] = {}


def _cpu_group() -> Any:
    """A CPU group of every rank, as the preemption flags use: the agreement never waits for an accelerator's queue.
    Made once per process group, when the first stream is iterated (at the same point on every rank)."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return reuse_groups(("streams",), lambda: dist.new_group(backend="gloo"))


def _lockstep(batches: Iterator[Any], group: Any) -> Iterator[Any]:
    yielded = 0
    while True:
        try:
            batch, has = next(batches), 1
        except StopIteration:
            batch, has = None, 0
        # [has, 1 - has] reduced by MIN: 0 first where some rank ran out, 0 second where some rank still had one.
        agreed = torch.tensor([has, 1 - has], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        if agreed[0] == 0:
            if agreed[1] == 0:
                rank_zero_warn(
                    f"A stream (IterableDataset) gave the ranks different numbers of batches: every rank stopped after"
                    f" {yielded}, where the shortest part ended, and the ranks with more left the rest out (going on,"
                    " they would wait in their next collective for a rank that had finished). Give every"
                    " data-parallel rank the same number of batches per epoch: drop the remainder, or pad it."
                )
            return
        yielded += 1
        yield batch


def _lockstep_class(base: type) -> type:
    if base not in _LOCKSTEP_CLASSES:
        def __iter__(self: DataLoader) -> Iterator[Any]:  # noqa: N807 - the method it overrides
            return _lockstep(base.__iter__(self), _cpu_group())

        _LOCKSTEP_CLASSES[base] = type(base.__name__, (base,), {"__iter__": __iter__, "__module__": base.__module__})
    return _LOCKSTEP_CLASSES[base]


def even_out_streams(dataloader: Any) -> Any:
    """Make ``dataloader`` end together on every rank if it reads an ``IterableDataset`` in a process group of more
    than one rank. It stays the same object, of a subclass of its class whose iterator agrees on each batch: its
    sampler, workers and attributes (which Lightning reads and sets after this) are untouched."""
    if (not isinstance(dataloader, DataLoader) or not isinstance(dataloader.dataset, IterableDataset)
            or not dist.is_initialized() or dist.get_world_size() == 1
            or type(dataloader) in _LOCKSTEP_CLASSES.values()):
        return dataloader
    dataloader.__class__ = _lockstep_class(type(dataloader))
    return dataloader
