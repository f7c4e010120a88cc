"""The loss in the logs is the loss of the global batch, under every layout.

Lightning's loggers and progress bar show what rank 0's ``training_step`` passed to ``self.log``: under data
parallelism (and expert parallelism, which lives inside it) rank 0's share of the global batch, under context
parallelism the mean over rank 0's part of every sequence. Plain DDP logs rank 0's share too; we log what one
process computes on the global batch instead, so a curve reads the same whatever the layout, without the user
adding ``sync_dist=True``.

The strategy captures the step's ``self.log`` calls; those that log the step's own loss (the tensor the step
returns, a detached view of it, or its value as a number) are logged as the mean over the ranks that hold
different data of the step's loss, weighed as training weighs it (a context-parallel rank's share of the valid
targets; with ``loss_normalization='tokens'`` each batch's valid targets). That costs one all-reduce of two numbers
per training step, and none where every rank holds the same data (tensor and pipeline parallelism alone: the
pipeline runner already hands every rank the last stage's loss). Other logged values are left as the user logged
them (``sync_dist=True`` averages them as usual).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Number
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["token_sum", "LoggedCall", "captured_logs", "global_loss", "is_the_loss", "reduce_fx_name", "replay_logs", "shadowed", "step_loss",
           "step_returns", "true_loss"]


@dataclass
class LoggedCall:
    name: str
    value: Any
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def reduce_fx_name(call: LoggedCall) -> str:
    """The call's ``reduce_fx`` by name: 'sum', 'max', 'min', or 'mean' (Lightning's default, and anything else)."""
    # log(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, ...): the fifth argument after the value
    fx = call.kwargs.get("reduce_fx", call.args[4] if len(call.args) > 4 else "mean")
    names = {torch.sum: "sum", torch.max: "max", torch.min: "min", sum: "sum", max: "max", min: "min"}
    return fx if isinstance(fx, str) and fx in ("sum", "max", "min") else names.get(fx, "mean")


@contextmanager
def shadowed(module: nn.Module, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """``module.<name>`` replaced by an instance attribute for the block; nested replacements each put back what was
    there before (the pipeline runner's capture inside the strategy's, a replica group's scheduler hook)."""
    had, previous = name in module.__dict__, module.__dict__.get(name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        if had:
            setattr(module, name, previous)
        else:
            delattr(module, name)  # the instance attribute shadowed the method


@contextmanager
def captured_logs(module: nn.Module, keep: Callable[[], bool] = lambda: True) -> Iterator[list[LoggedCall]]:
    """Record ``module.log`` calls instead of logging them (those made while ``keep()`` is true)."""
    calls: list[LoggedCall] = []

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if keep():
            calls.append(LoggedCall(name, value, args, kwargs))

    with shadowed(module, "log", record):
        yield calls


@contextmanager
def step_returns(module: nn.Module, method: str) -> Iterator[list[Any]]:
    """What ``module.<method>`` returns, kept as it returned it: the root's forward hooks may replace the step's
    output on its way out (DDP's clones every output tensor), and the logged loss is recognized by identity."""
    returned: list[Any] = []
    bound = getattr(module, method)

    def keep(*args: Any, **kwargs: Any) -> Any:
        returned.append(out := bound(*args, **kwargs))
        return out

    with shadowed(module, method, keep):
        yield returned


def step_loss(output: Any, returned: list[Any] | None = None) -> Tensor | None:
    """The loss a training step returned (a tensor, or a dict's ``loss``): as the step returned it where it ran once
    (``returned``, from ``step_returns``), since the root's hooks may replace ``output`` (DDP's clone it)."""
    output = returned[0] if returned is not None and len(returned) == 1 else output
    loss = output.get("loss") if isinstance(output, dict) else output
    return loss if isinstance(loss, Tensor) and loss.numel() == 1 else None


def is_the_loss(value: Any, loss: Tensor) -> bool:
    """Whether a logged value is the step's loss: the tensor itself, a detached view of it, or its value."""
    if value is loss:
        return True
    if isinstance(value, Tensor):
        return (value.numel() == 1 and value.device == loss.device
                and value.untyped_storage().data_ptr() == loss.untyped_storage().data_ptr()
                and value.storage_offset() == loss.storage_offset())
    return isinstance(value, Number) and not isinstance(value, bool) and float(value) == float(loss)


def token_sum(means: Tensor, counts: Tensor) -> Tensor:
    """Sum of per-part means weighed by their valid targets; a part without any (its labels all ignored) counts for
    nothing, where its NaN mean (0/0) times zero would make the sum NaN."""
    return torch.where(counts > 0, means * counts, 0.0).sum()


def global_loss(loss: Tensor, weight: float, tokens: float, group: dist.ProcessGroup | None) -> Tensor:
    """The loss of the global batch from this rank's: ``weight`` x ``loss`` weighed by ``tokens`` (1 under mean
    normalization), summed and divided by the tokens over ``group``. Ranks holding the same data (tensor and
    pipeline peers) add equal terms to the sum and to the count, so the whole world can be the group."""
    local = loss.detach().double()
    pair = torch.stack([token_sum(local * weight, local.new_tensor(float(tokens))), torch.full_like(local, float(tokens))])
    dist.all_reduce(pair, group=group)
    # No valid target anywhere (every label ignored): the step's own value, not 0/0.
    return torch.where(pair[1] > 0, pair[0] / pair[1].clamp_min(1e-30), local).to(loss.dtype)


def true_loss(layout: Any, runner: Any, cp: Any, counter: Any, loss: Tensor | None) -> Tensor | None:
    """The global batch's loss for a step of ``layout`` that returned ``loss`` (with its pipeline ``runner``, context
    parallelism ``cp`` and token ``counter``, each None without); None where the ranks that hold different data are
    one (the step's loss is already the global batch's on every rank)."""
    if loss is None or layout.dp_replicate * layout.dp_shard * layout.cp == 1:
        return None
    # Under pipeline parallelism the runner's loss carries the context-parallel weights and the token mean already.
    weight = cp.weight() if cp is not None and cp.active and runner is None else 1.0
    tokens = 1.0 if counter is None else runner.step_tokens if runner is not None else counter.settled()
    return global_loss(loss, weight, float(tokens), None)


def replay_logs(module: nn.Module, calls: list[LoggedCall], loss: Tensor | None, true: Tensor | None) -> None:
    """Log the captured calls, with ``true`` in place of the step's ``loss`` wherever that was logged."""
    for call in calls:
        value = true if loss is not None and true is not None and is_the_loss(call.value, loss) else call.value
        module.log(call.name, value, *call.args, **call.kwargs)
