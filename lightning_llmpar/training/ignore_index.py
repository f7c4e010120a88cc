"""The ignore index the training loss actually uses, read from its ``cross_entropy``/``nll_loss`` calls.

Counting valid targets (``loss_normalization='tokens'``) and looking for padding (the warning under ``'mean'``)
must skip the targets the loss skips. -100 is torch's and transformers' default, but a loss may ignore the pad
token itself (``ignore_index=tokenizer.pad_token_id``): counted as -100 those targets would all count, and the
step's mean would silently be the wrong one. So the first training steps run under a function mode that notes the
``ignore_index`` of the loss calls (of the call with the most targets, the token-level loss, where several ignore
different ones), and the ranks agree on it: under pipeline parallelism only the last stage computes the loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["IGNORE_INDEX", "IgnoreIndex", "note_loss_call"]

IGNORE_INDEX = -100
_ARG = 4  # ignore_index's position in both F.cross_entropy(input, target, weight, size_average, ignore_index, ...)
_LOSSES = (F.cross_entropy, F.nll_loss)


class _LossCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: tuple[int, int] | None = None  # (targets, ignore_index) of the call with the most targets

    def note(self, target: torch.Tensor, index: int) -> None:
        if self.seen is None or target.numel() > self.seen[0]:
            self.seen = (target.numel(), int(index))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[1] if len(args) > 1 else kwargs.get("target")
        if func in _LOSSES and isinstance(target, torch.Tensor):
            self.note(target, kwargs.get("ignore_index", args[_ARG] if len(args) > _ARG else IGNORE_INDEX))
        return func(*args, **kwargs)


_watching: list[_LossCalls] = []  # the watch of the step in flight, if any


def note_loss_call(target: torch.Tensor, ignore_index: int) -> None:
    """A cross-entropy that a function mode above the watch computed itself (loss parallelism's, which splits the
    logits once the head has run, so it opens after the watch), noted as if the watch had seen it."""
    if _watching:
        _watching[-1].note(target, ignore_index)


class IgnoreIndex:
    """The loss's ignore index (``value``: -100 until a loss call says otherwise), watched over the first ``looks``
    training steps that call one on some rank."""

    def __init__(self, device: torch.device, looks: int = 8) -> None:
        self.value, self.looks, self.device = IGNORE_INDEX, looks, device
        self._mode: _LossCalls | None = None

    @contextmanager
    def watch(self, training: bool) -> Iterator[None]:
        """Around a step: its loss calls noted. Training steps then agree on the index across ranks (one small
        all-gather per watched step, every rank steps together); an evaluation step's note stays this rank's."""
        if self.looks <= 0 or self._mode is not None:  # not watching, or a step inside a step (nothing new)
            yield
            return
        self._mode = mode = _LossCalls()
        _watching.append(mode)
        try:
            with mode:
                yield
        finally:
            self._mode = None
            _watching.remove(mode)
        seen = mode.seen
        if training:
            self.looks -= 1
            seen = _agreed(seen, self.device)
        if seen is not None:
            self.value = seen[1]
            self.looks = 0 if training else self.looks

    def noted(self) -> int:
        """The index as far as known now: within a watched step, what its loss calls so far said (a pipeline's
        last stage counts each microbatch right after its loss)."""
        seen = self._mode.seen if self._mode is not None else None
        return seen[1] if seen is not None else self.value


def _agreed(seen: tuple[int, int] | None, device: torch.device) -> tuple[int, int] | None:
    """The note of the rank that saw the most targets, on every rank (None where no rank saw a loss call)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seen
    mine = torch.tensor(seen if seen is not None else (-1, IGNORE_INDEX), dtype=torch.int64, device=device)
    notes = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(notes, mine)
    best = max(notes, key=lambda t: int(t[0]))
    return (int(best[0]), int(best[1])) if int(best[0]) >= 0 else None
