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
        # (targets, ignore_index, another index of a call with as many targets, or the same) of the call with the most
        self.seen: tuple[int, int, int] | None = None

    def note(self, target: torch.Tensor, index: int) -> None:
        if self.seen is None or target.numel() > self.seen[0]:
            self.seen = (target.numel(), int(index), int(index))
        elif target.numel() == self.seen[0] and int(index) != self.seen[1]:
            self.seen = (self.seen[0], self.seen[1], int(index))

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
    training steps that call one on some rank; evaluation steps' own (``evaluated``), which may differ (a validation
    loss over labels padded another way), over their first ``looks``. ``decisive``: the index counts targets
    (``loss_normalization='tokens'``, context parallelism), so two losses that cannot be told apart are refused."""

    def __init__(self, device: torch.device, looks: int = 8, decisive: bool = False) -> None:
        self.value, self.looks, self.device, self.decisive = IGNORE_INDEX, looks, device, decisive
        self.evaluated: int | None = None
        self._evaluation_looks, self._training = looks, True
        self._mode: _LossCalls | None = None

    @contextmanager
    def watch(self, training: bool) -> Iterator[None]:
        """Around a step: its loss calls noted. Training steps then agree on the index across ranks (one small
        all-gather per watched step, every rank steps together); an evaluation step's note stays this rank's."""
        if self._mode is not None:  # a step inside a step (nothing new)
            yield
            return
        self._training = training
        if (self.looks if training else self._evaluation_looks) <= 0:
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
        if not training:
            self._evaluation_looks = 0 if seen is not None else self._evaluation_looks - 1
            self.evaluated = seen[1] if seen is not None else self.evaluated
            return
        self.looks -= 1
        seen = _agreed(seen, self.device)
        if seen is not None:
            self.value, self.looks = seen[1], 0
            if self.decisive and seen[2] != seen[1]:
                raise ValueError(
                    f"The training step's loss calls ignore different targets (ignore_index={seen[1]} and"
                    f" {seen[2]}) over the same number of targets ({seen[0]}), so which of them counts the step's"
                    " tokens (loss_normalization='tokens', context parallelism's weights) cannot be told. Pass"
                    " loss_normalization=callable(batch) -> the number of targets to weigh the step by, or"
                    " loss_normalization='mean' without context parallelism."
                )

    def noted(self) -> int:
        """The index as far as known now: within a watched step, what its loss calls so far said (a pipeline's
        last stage counts each microbatch right after its loss); after an evaluation step, evaluation's own."""
        seen = self._mode.seen if self._mode is not None else None
        if seen is not None:
            return seen[1]
        if not self._training and self.evaluated is not None:
            return self.evaluated
        return self.value


def _agreed(seen: tuple[int, int, int] | None, device: torch.device) -> tuple[int, int, int] | None:
    """The note of the rank that saw the most targets, on every rank (None where no rank saw a loss call)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seen
    mine = torch.tensor(seen if seen is not None else (-1, IGNORE_INDEX, IGNORE_INDEX), dtype=torch.int64, device=device)
    notes = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(notes, mine)
    best = max(notes, key=lambda t: int(t[0]))
    return (int(best[0]), int(best[1]), int(best[2])) if int(best[0]) >= 0 else None
