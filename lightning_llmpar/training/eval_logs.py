"""A validation loss over data-parallel ranks as one process computes it, under ``loss_normalization='tokens'``.

An evaluation step's ``self.log(name, value, sync_dist=True)`` is averaged by Lightning over the ranks that hold
different data: the mean of their means. Under ``'tokens'`` one process's value of a per-token mean (a validation
loss over padded or packed rows) is the global batch's, each rank's share weighed by its valid targets; with
padded rows the two differ (5.0071 against 5.0108 at dp2 in a measured case), and checkpoint names and
``save_top_k`` choices with them. So each such value is replaced, step by step, by the ranks' token-weighted
mean, which every rank then logs alike (Lightning's own reduction of equal values leaves it as it is). The pipeline
combines its microbatches the same way (``pipeline.logs``). Values logged with another ``reduce_fx``, without
``sync_dist`` or as a torchmetrics ``Metric`` are left as logged. One all-reduce per evaluation step that logs such
values.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from numbers import Number
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_llmpar.training.logged_loss import LoggedCall, captured_logs, reduce_fx_name, replay_logs

__all__ = ["evaluation_logs", "token_weighted"]

_SYNC_DIST = 6  # its position after the value in LightningModule.log(name, value, prog_bar, ...)


@contextmanager
def evaluation_logs(module: Any, composed: Any, batch: Any, group: Any, device: torch.device) -> Iterator[None]:
    """Around an evaluation step of ``composed`` (the strategy's set-up) on ``batch``: its synced means
    token-weighted over the data-parallel ``group`` (what ``sync_dist`` reduces over), where tokens are counted and
    data-parallel ranks hold different data. Under context parallelism evaluation is left to its own logging."""
    if composed is None or composed.tokens is None or composed.layout.dp == 1 or composed.layout.cp > 1:
        yield
        return
    with captured_logs(module) as calls:
        yield
    try:
        tokens = int(composed.tokens.count(batch))
    except ValueError:  # evaluation data without the targets training counts: equal weights, as Lightning's
        tokens = 1
    replay_logs(module, token_weighted(calls, tokens, group, device), None, None)


def token_weighted(calls: list[LoggedCall], tokens: int, group: Any, device: torch.device) -> list[LoggedCall]:
    """``calls`` with every synced mean replaced by its mean over ``group`` weighed by each rank's ``tokens``."""
    chosen = [i for i, call in enumerate(calls) if _synced_mean(call)]
    if not chosen:
        return calls
    values = torch.tensor([_number(calls[i].value) for i in chosen], dtype=torch.float64, device=device)
    counts = torch.full_like(values, float(tokens))
    # A rank without valid targets (its mean NaN, 0/0) counts for nothing, as in the training loss's token_sum.
    sums = torch.stack([torch.where(counts > 0, values * counts, 0.0), counts])
    dist.all_reduce(sums, group=group)
    means = torch.where(sums[1] > 0, sums[0] / sums[1].clamp_min(1e-30), values)  # no target anywhere: as logged
    out = list(calls)
    for i, mean in zip(chosen, means.tolist()):
        call = calls[i]
        value = call.value
        new = torch.tensor(mean, dtype=value.dtype, device=value.device) if isinstance(value, Tensor) else mean
        out[i] = LoggedCall(call.name, new, call.args, call.kwargs)
    return out


def _synced_mean(call: LoggedCall) -> bool:
    sync = call.kwargs.get("sync_dist", call.args[_SYNC_DIST] if len(call.args) > _SYNC_DIST else False)
    number = isinstance(call.value, Tensor) and call.value.numel() == 1 and call.value.is_floating_point()
    number = number or (isinstance(call.value, Number) and not isinstance(call.value, bool))
    return bool(sync) and reduce_fx_name(call) == "mean" and number


def _number(value: Any) -> float:
    return float(value.detach()) if isinstance(value, Tensor) else float(value)
