"""Per-rank head counts and widths on a model's modules, and the whole model's values beside them.

Tensor parallelism gives each attention and MLP module this rank's counts (heads, key/value heads, widths) so the
model's own reshapes work on its shards; code that builds whole tensors from those counts (transformers' weight
init, pretrained loading) needs the whole model's values for a moment. Both sides live here, below every
dimension, so that ``modeling`` never reaches up into ``tensor_parallel``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

__all__ = ["set_local_counts", "whole_counts"]

_COUNTS = "_llmpar_counts"  # on a module: attribute -> (the whole model's value, this rank's value)


def _get(module: nn.Module, attr: str) -> Any:
    owner, _, leaf = attr.rpartition(".")
    return getattr(module.config if owner == "config" else module, leaf)


def _set(module: nn.Module, attr: str, value: Any) -> None:
    owner, _, leaf = attr.rpartition(".")
    setattr(module.config if owner == "config" else module, leaf, value)


def set_local_counts(model: nn.Module, local_counts: Mapping[str, Mapping[str, Any]]) -> None:
    """Give each named module this rank's values (``attr`` or ``config.attr``), remembering the whole model's."""
    for name, counts in local_counts.items():
        module = model.get_submodule(name)
        for attr, value in counts.items():
            if attr.startswith("config.") and not getattr(module, "_llmpar_own_config", False):
                module.config = copy.copy(module.config)  # the model's config is shared by every layer
                module._llmpar_own_config = True
            module.__dict__.setdefault(_COUNTS, {})[attr] = (_get(module, attr), value)
            _set(module, attr, value)


@contextlib.contextmanager
def whole_counts(model: nn.Module) -> Iterator[None]:
    """The whole model's head counts and widths while code that builds whole tensors from them runs (transformers'
    init: ``A_log = log(arange(1, num_heads + 1))``); this rank's again after."""
    patched = [(m, attr, whole, local) for m in model.modules() for attr, (whole, local) in getattr(m, _COUNTS, {}).items()]
    for module, attr, whole, _ in patched:
        _set(module, attr, whole)
    try:
        yield
    finally:
        for module, attr, _, local in patched:
            _set(module, attr, local)
