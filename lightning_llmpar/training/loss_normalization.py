"""Token-exact losses: the mean over every valid target token of the optimizer step, as one process computes it.

By default (``loss_normalization="mean"``, what DDP and FSDP do) each microbatch's and each data-parallel
rank's mean loss weighs the same, which differs from one process's mean over valid tokens when padding or
``ignore_index`` leaves microbatches with different numbers of them. With ``"tokens"`` each loss is weighted
by its number of valid targets before backward, and the step's gradients are divided by the total over all
microbatches, accumulation steps and data-parallel ranks (one all-reduce) before clipping and the update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["TokenNormalizer", "count_target_tokens"]

IGNORE_INDEX = -100


def count_target_tokens(batch: Any) -> int:
    """Valid targets of a batch: a dict's ``labels`` shifted by one as transformers' causal-LM loss does, a dict's
    ``targets`` (already shifted: the bundled packed rows), or the targets (second element) of an ``(inputs,
    targets)`` pair; ``-100`` marks ignored positions."""
    if isinstance(batch, dict) and isinstance(batch.get("labels"), Tensor):
        return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())
    if isinstance(batch, dict) and isinstance(batch.get("targets"), Tensor):
        return int((batch["targets"] != IGNORE_INDEX).sum())
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[1], Tensor):
        return int((batch[1] != IGNORE_INDEX).sum())
    raise ValueError(
        f"loss_normalization='tokens' counts valid targets in a dict's 'labels' or 'targets' or the second element of a"
        f" tuple; this"
        f" {type(batch).__name__} batch has neither. Pass loss_normalization=<callable(batch) -> number of tokens>."
    )


class TokenNormalizer:
    """Counts the valid tokens behind each loss of a step and rescales the step's gradients by their total."""

    def __init__(self, count: Callable[[Any], int], tp: int, dp: int, device: torch.device) -> None:
        self.count, self.tp, self.dp, self.device = count, tp, dp, device
        self.tokens = 0  # on this rank, since the last optimizer step, for losses this rank computed
        self.step_tokens = 1  # behind the loss of the micro-step in flight (its backward weighs the mean by it)

    def add(self, batch: Any) -> int:
        n = int(self.count(batch))
        self.tokens += n
        self.step_tokens = n
        return n

    @torch.no_grad()
    def finish(self, params: Iterable[Tensor], accumulate: int) -> None:
        """Turn the accumulated sum of token-weighted gradients into the per-token mean of the step.

        Gradients hold (1/dp)(1/accumulate) x sum over losses of (tokens x gradient of the mean loss):
        data-parallel averaging and Lightning's accumulation divide; multiplying by dp x accumulate / N leaves
        the sum over all tokens divided by N. Every tensor-parallel rank counted the same tokens, so the world
        sum is divided by tp.
        """
        total = torch.tensor([float(self.tokens)], dtype=torch.float64, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        tokens = float(total) / self.tp
        self.tokens = 0
        if tokens <= 0:
            return
        factor = self.dp * accumulate / tokens
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)
