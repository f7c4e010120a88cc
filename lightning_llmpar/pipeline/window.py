"""A block stack narrowed to one pipeline stage: the blocks of the stage's window, pass-throughs before it.

A rank keeps only its stages' blocks (under their keys, so parameter names are the whole model's); while a stage
runs the user's step, iterating the stack (a ModuleList, or a ModuleDict's ``values()`` / ``items()`` as
torchtitan's models do) yields pass-throughs for the blocks before the window and stops after its last block.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_llmpar.modeling.structure import Stack, stack_keys

__all__ = ["ListForm", "meta_copy", "narrow_blocks", "output_form", "widen_blocks"]


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on the meta device, made without copying its data."""
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(module, memo)


class _PassThrough(nn.Module):
    """Stands for a block before the current stage's first block: returns its input unchanged, in the form the
    block's output has (a tuple led by it: Bamba's forward unpacks two values from every block), and answers
    reads of the block's plain attributes (Nemotron-H's forward reads each block's ``block_type``). Both come
    from a copy of the block on the meta device. The output form is the one seen in a run of the whole model
    when there was one; else the copy's, on the first call (code the meta device cannot run, such as grouped
    expert kernels, cannot tell it)."""

    def __init__(self, block: nn.Module, form: tuple | None = None) -> None:
        super().__init__()
        self._meta = [meta_copy(block)]  # list: not a submodule
        self._form = form  # () a tensor; else the tuple's items (None where a tensor is)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))
        if self._form is None:
            self._form = self._find_form(args, kwargs)
        if not self._form:
            return first
        out = tuple(first if i == 0 else item for i, item in enumerate(self._form))
        return list(out) if isinstance(self._form, ListForm) else out

    def _find_form(self, args: tuple, kwargs: dict) -> tuple:
        to_meta = lambda t: t.to("meta") if isinstance(t, Tensor) else t  # noqa: E731
        try:
            out = self._meta[0](*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        except Exception:  # noqa: BLE001 - code the meta device cannot run: take the block for one returning a tensor
            return ()
        return output_form(out)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            value = getattr(self._meta[0], name)
        if isinstance(value, Tensor):
            raise AttributeError(f"{name!r} of a block on another pipeline stage")
        # A submodule answers from the meta copy: a forward that walks every block's weights in place (RWKV rescales
        # them when switching between training and eval) leaves other stages' blocks to their own stage; a value
        # computed from a meta tensor cannot meet a real one without an error.
        return value


class ListForm(tuple):
    """The form of a block that returns a list (OpenAI GPT's blocks), not a tuple."""


def output_form(out: Any) -> tuple:
    """A block output's form: () for a tensor, else a tuple's (or list's: :class:`ListForm`) items with None where
    a tensor is. Other tensors (attention weights when asked for) are not faked by a pass-through: code using them
    fails loudly."""
    if not isinstance(out, (tuple, list)) or not out or not isinstance(out[0], Tensor):
        return ()
    items = (None if isinstance(item, Tensor) else item for item in out)
    return ListForm(items) if isinstance(out, list) else tuple(items)


def narrow_blocks(blocks: Stack, forms: Sequence[tuple] = ()) -> None:
    """Turn ``blocks`` into a ``_StageBlocks`` (``_StageBlockDict`` for a ModuleDict), before any block is removed:
    each gets its pass-through, with the output form seen in a run of the whole model, if any."""
    keys = stack_keys(blocks)
    passes = [_PassThrough(blocks._modules[key], forms[i] if i < len(forms) else None) for i, key in enumerate(keys)]
    kinds = {nn.ModuleDict: _StageBlockDict, nn.Sequential: _StageSequential}
    blocks.__class__ = next((k for base, k in kinds.items() if isinstance(blocks, base)), _StageBlocks)
    blocks._llmpar_total, blocks._llmpar_passes = len(passes), passes  # type: ignore[union-attr]
    blocks._llmpar_window, blocks._llmpar_entered = None, False  # type: ignore[union-attr]
    blocks._llmpar_keys = keys  # type: ignore[union-attr]


def widen_blocks(blocks: Stack, original_class: type) -> None:
    """Undo ``narrow_blocks`` on a stack that kept all its blocks (the split check)."""
    blocks.__class__ = original_class
    for attr in ("_llmpar_total", "_llmpar_passes", "_llmpar_window", "_llmpar_entered", "_llmpar_keys"):
        blocks.__dict__.pop(attr, None)


class _Window:
    """What a stage's stack yields: this rank's blocks in the active stage's window.

    Blocks of other ranks are removed but the remaining keep their keys as names, so parameter names are the same
    in every layout.
    """

    _modules: dict[str, nn.Module]
    _llmpar_total: int
    _llmpar_passes: list[_PassThrough]
    _llmpar_window: tuple[int, ...] | None
    _llmpar_entered: bool
    _llmpar_keys: list[str]

    def _active(self, indices: Sequence[int]) -> list[tuple[str, nn.Module]]:
        keys, window = self._llmpar_keys, self._llmpar_window
        if window is None:
            return [(keys[i], self._modules[keys[i]]) for i in indices if keys[i] in self._modules]
        # Blocks before the stage's window run as pass-throughs (their output is replaced by the received
        # activation), so a forward that pairs blocks with per-layer lists by position (enumerate,
        # zip(layer_types, layers)) keeps every block at its own index. Nothing after the window runs.
        return [(keys[i], self._modules[keys[i]] if i in window else self._llmpar_passes[i])
                for i in indices if i < window[-1] + 1]

    def __len__(self) -> int:
        return self._llmpar_total


class _StageBlocks(_Window, nn.ModuleList):
    """A ModuleList stack narrowed to a pipeline rank's blocks."""

    def __iter__(self):  # type: ignore[override]
        return iter([m for _, m in self._active(range(self._llmpar_total))])

    def __getitem__(self, idx: int | slice) -> Any:  # type: ignore[override]
        if isinstance(idx, slice):
            return [m for _, m in self._active(range(self._llmpar_total)[idx])]
        i = idx if idx >= 0 else self._llmpar_total + idx
        window = self._llmpar_window
        if window is not None and 0 <= i < window[0]:
            return self._llmpar_passes[i]  # a forward that indexes (layers[i]) reaches it as iteration does
        if str(i) not in self._modules:
            held = [int(k) for k in self._modules]
            raise IndexError(f"Block {idx} of {self._llmpar_total} is on another pipeline rank; this rank holds blocks"
                             f" {held[0]}-{held[-1]}. Code outside the model's forward reaches only these." if held
                             else f"Block {idx} is on another pipeline rank; this rank holds none of the stack.")
        return self._modules[str(i)]


class _StageSequential(_Window, nn.Sequential):
    """An ``nn.Sequential`` stack narrowed to a pipeline rank's blocks: called whole by the model's forward, it runs
    the active window (after the pass-throughs) as a ModuleList stack's iteration does."""

    __iter__ = _StageBlocks.__iter__
    __getitem__ = _StageBlocks.__getitem__  # type: ignore[assignment]


class _StageBlockDict(_Window, nn.ModuleDict):
    """A ModuleDict stack (torchtitan's ``layers``) narrowed to a pipeline rank's blocks: ``values()``, ``items()``
    and ``keys()`` walk the active window as a ModuleList stack's iteration does."""

    def __iter__(self):  # type: ignore[override]
        return iter(self.keys())

    def keys(self) -> list[str]:  # type: ignore[override]
        return [k for k, _ in self._active(range(self._llmpar_total))]

    def items(self) -> list[tuple[str, nn.Module]]:  # type: ignore[override]
        return self._active(range(self._llmpar_total))

    def values(self) -> list[nn.Module]:  # type: ignore[override]
        return [m for _, m in self._active(range(self._llmpar_total))]

    def __contains__(self, key: object) -> bool:
        return key in self._llmpar_keys

    def __getitem__(self, key: str) -> nn.Module:  # type: ignore[override]
        if key not in self._llmpar_keys:
            raise KeyError(key)
        position = self._llmpar_keys.index(key)
        window = self._llmpar_window
        if window is not None and position < window[0]:
            return self._llmpar_passes[position]  # a forward that indexes by key (layers[str(i)]) reaches it too
        return self._modules[key]
