"""Loaders that make a data-parallel run differ from one process's without an error: named in a warning.

- A ``DistributedSampler`` in order (``shuffle=False``: Lightning's for validation and test, ``ordered_loader``'s)
  over a dataset the data-parallel ranks do not divide repeats samples to even them out: the validation loss of 7
  samples at dp2 was 5.0858 where one process logs 5.0707, silently during fit.
- ``overfit_batches`` with ``use_distributed_sampler=False``: Lightning replaces every loader's sampler, the user's
  ``DistributedSampler`` too, with a ``SequentialSampler`` over the whole dataset, so every data-parallel rank
  trained on the same batches (losses 0.3 off one process's at dp2).

And one that fails: Lightning's predict sampler does not pad, so a predict set the ranks do not divide gives them
different numbers of batches; with sharded parameters every forward needs every rank of the shard group, and the
rank with one batch more waited for a peer that had finished (a gloo abort here, a hang on GPUs). Refused.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DistributedSampler, SequentialSampler

__all__ = ["check_loader"]


def check_loader(dataloader: Any, trainer: Any, data_ranks: int, zero_stage: int = 0) -> None:
    """Warn (on rank zero) about ``dataloader`` as above, or refuse it; ``data_ranks``: the data-parallel degree,
    ``zero_stage``: the strategy's (stages 1-3 shard the parameters over the data-parallel ranks)."""
    sampler = getattr(dataloader, "sampler", None)
    # Lightning's predict loader: its batch sampler holds the distributed sampler, the batch size and drop_last.
    batches_of = getattr(dataloader, "batch_sampler", None)
    unrepeated, batch = getattr(batches_of, "sampler", None), getattr(batches_of, "batch_size", None)
    if zero_stage and isinstance(unrepeated, UnrepeatedDistributedSampler) and batch:
        samples, ranks = len(unrepeated.dataset), unrepeated.num_replicas  # type: ignore[arg-type]
        counts = [len(range(r, samples, ranks)) for r in range(ranks)]
        batches = [c // batch if getattr(batches_of, "drop_last", False) else math.ceil(c / batch) for c in counts]
        if len(set(batches)) > 1:
            raise ValueError(
                f"trainer.predict on {samples} samples in batches of {batch} gives the {ranks} data-parallel ranks"
                f" {batches} batches; under zero_stage={zero_stage} every forward needs every rank (their parameter"
                " shards), so a rank with a batch more would wait for peers that have finished (a hang on GPUs)."
                f" Predict on a multiple of {ranks * batch} samples (pad the set and drop the extra predictions), or"
                " with zero_stage=0."
            )
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
