"""Loaders that make a data-parallel run differ from one process's without an error: named in a warning.

- A ``DistributedSampler`` in order (``shuffle=False``: Lightning's for validation and test, ``ordered_loader``'s)
  over a dataset the data-parallel ranks do not divide repeats samples to even them out: the validation loss of 7
  samples at dp2 was 5.0858 where one process logs 5.0707, silently during fit.
- ``overfit_batches`` with ``use_distributed_sampler=False``: Lightning replaces every loader's sampler, the user's
  ``DistributedSampler`` too, with a ``SequentialSampler`` over the whole dataset, so every data-parallel rank
  trained on the same batches (losses 0.3 off one process's at dp2).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DistributedSampler, SequentialSampler

__all__ = ["check_loader"]


def check_loader(dataloader: Any, trainer: Any, data_ranks: int) -> None:
    """Warn (on rank zero) about ``dataloader`` as above; ``data_ranks``: the data-parallel degree."""
    sampler = getattr(dataloader, "sampler", None)
    if (trainer is not None and trainer.overfit_batches and data_ranks > 1 and isinstance(sampler, SequentialSampler)
            and not trainer._accelerator_connector.use_distributed_sampler):
        rank_zero_warn(
            "overfit_batches with use_distributed_sampler=False: Lightning replaced the loader's sampler (your"
            f" DistributedSampler too) with a SequentialSampler over the whole dataset, so each of the {data_ranks}"
            " data-parallel ranks trains on the same first batches unless the dataset is already that rank's part."
            " Set use_distributed_sampler=True: Lightning then splits those batches over the ranks."
        )
    if isinstance(sampler, DistributedSampler) and not sampler.shuffle:
        samples = len(sampler.dataset)  # type: ignore[arg-type]
        if sampler.total_size > samples:
            rank_zero_warn(
                f"The data's {samples} samples do not divide over {sampler.num_replicas} data-parallel ranks: an"
                f" in-order DistributedSampler (Lightning's for validation and test) repeats"
                f" {sampler.total_size - samples} of them to even the ranks out, so what is evaluated and logged (and"
                " a checkpoint's monitored value) counts them twice and differs from one process's. Use a multiple of"
                f" {sampler.num_replicas} samples."
            )
