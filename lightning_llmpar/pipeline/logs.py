"""What the pipeline's last stage logged and returned over a step's microbatches, as one batch's, for every rank.

Only the last stage runs the step to the end, once per microbatch. Each name's values become one: a torchmetrics
``Metric`` stays itself (it accumulated every microbatch), the step's own loss stays "the loss" (the runner logs the
step's loss, which the strategy then logs as the global batch's), and any other value is the mean over the
microbatches: weighed by each microbatch's valid targets under ``loss_normalization='tokens'`` (so a per-token mean,
such as a validation loss over padded or packed rows, is the batch's, as one process logs it; a microbatch without
any counts for nothing), else equally. A value logged with ``reduce_fx="sum"``, ``"max"`` or ``"min"`` (a count, a
largest loss) is combined so instead: the batch's sum is the microbatches' sum, its max their max.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_llmpar.training.batches import same_sequence
from lightning_llmpar.training.logged_loss import LoggedCall, is_the_loss, reduce_fx_name, token_sum

__all__ = ["eval_tokens", "merge_outputs", "summarize_logs"]

Summary = list[tuple[str, tuple[str, Any], tuple, dict[str, Any]]]


def eval_tokens(counter: Any, batch: Any) -> int | None:
    """An evaluation microbatch's valid targets, or None where its batch holds none to count (evaluation data may
    come without the targets training counts)."""
    try:
        return int(counter.count(batch))
    except ValueError:
        return None


def summarize_logs(calls: list[LoggedCall], microbatches: int, raw_losses: list[Tensor], weights: list[Any],
                   metric_names: dict[int, str]) -> Summary:
    """(name, (kind, payload), args, kwargs) per logged name: kind 'metric' (payload: its module name), 'loss' or
    'value' (payload: the mean). ``weights``: the microbatches' valid targets (None where not countable), or empty
    for equal weights."""
    values: dict[str, list[Any]] = defaultdict(list)
    call_of: dict[str, LoggedCall] = {}
    for call in calls:
        values[call.name].append(call.value)
        call_of[call.name] = call
    summary: Summary = []
    for name, vals in values.items():
        last, call = vals[-1], call_of[name]
        if isinstance(last, Metric):
            payload: tuple[str, Any] = ("metric", metric_names.get(id(last), ""))
        elif len(vals) == len(raw_losses) and raw_losses and all(is_the_loss(v, r) for v, r in zip(vals, raw_losses)):
            payload = ("loss", None)
        else:
            nums = [float(v.detach().double().mean()) if isinstance(v, Tensor) else float(v) for v in vals[-microbatches:]]
            payload = ("value", _combine(nums, weights, reduce_fx_name(call)))
        summary.append((name, payload, call.args, call.kwargs))
    return summary


def _combine(nums: list[float], weights: list[Any], reduce_fx: str) -> float:
    if reduce_fx == "sum":
        return sum(nums)
    if reduce_fx in ("max", "min"):
        return max(nums) if reduce_fx == "max" else min(nums)
    w = [float(x) for x in weights[-len(nums) :] if x is not None]
    if len(w) != len(nums) or sum(w) <= 0:  # no count for some microbatch (or none anywhere): equal weights
        w = [1.0] * len(nums)
    # A microbatch whose labels are all ignored (its mean NaN, 0/0) counts for nothing, as in one process's mean.
    total = token_sum(torch.tensor(nums, dtype=torch.float64), torch.tensor(w, dtype=torch.float64))
    return float(total) / sum(w)


def merge_outputs(outs: list[Any]) -> Any:
    """What a step returned for each microbatch, as one batch's: tensors with a batch dimension concatenated,
    tuples, lists and dicts entry by entry, numbers (and 0-dim tensors) averaged, with a warning: a number for
    the whole batch may be a mean, which averaging keeps, or a sum or count, which it does not."""
    if not outs or all(o is None for o in outs):
        return None
    first = outs[0]
    if all(isinstance(o, Tensor) for o in outs):
        outs = [o.detach() for o in outs]
        if first.dim() > 0:
            return torch.cat(outs)
        _warn_averaged()
        return torch.stack(outs).double().mean().to(first.dtype if first.is_floating_point() else torch.float32)
    if all(isinstance(o, dict) for o in outs):
        return {k: merge_outputs([o[k] for o in outs]) for k in first}
    if isinstance(first, (tuple, list)) and all(type(o) is type(first) and len(o) == len(first) for o in outs):
        return same_sequence(first, [merge_outputs(list(column)) for column in zip(*outs)])
    if all(isinstance(o, (int, float)) and not isinstance(o, bool) for o in outs):
        _warn_averaged()
        return sum(outs) / len(outs)
    return outs


def _warn_averaged() -> None:
    warnings.warn(  # by the last stage, where the outputs are (rank zero may hold the first)
        "A step under pipeline parallelism returned a number for its batch (a Python number or a 0-dim tensor): the"
        " step runs once per microbatch, and these numbers are averaged, which is right for a mean and not for a sum"
        " or a count. Return a tensor with one entry per sample to get one process's values.",
        stacklevel=2,
    )
