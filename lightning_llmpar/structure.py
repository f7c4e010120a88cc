"""The model convention every technique relies on: a stack of identical blocks inside the model.

Most transformer LMs keep their layers in one ``nn.ModuleList`` (``model.layers``, ``transformer.h``,
``blocks``...). We find it by structure, not by name, so a model written elsewhere fits unchanged.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

__all__ = ["BlockStack", "find_block_stack", "first_arg_name", "num_params"]


@dataclass(frozen=True)
class BlockStack:
    """Where the repeated blocks live: ``prefix`` is the ModuleList's qualified name."""

    prefix: str
    blocks: nn.ModuleList

    def names(self) -> list[str]:
        # Keys, not positions: under pipeline parallelism a rank keeps only some blocks, under their
        # original indices.
        return [f"{self.prefix}.{key}" if self.prefix else key for key in self.blocks._modules]

    def modules(self) -> list[nn.Module]:
        return [m for m in self.blocks._modules.values() if m is not None]

    @property
    def total(self) -> int:
        """Number of blocks in the whole model (also on a pipeline rank that holds only some)."""
        return len(self.blocks)


def first_arg_name(module: nn.Module) -> str:
    """Name of the first argument of ``module.forward`` (callers may pass it by keyword)."""
    params = [p for p in inspect.signature(module.forward).parameters.values() if p.kind != p.VAR_KEYWORD]
    return params[0].name if params else ""


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_block_stack(model: nn.Module) -> BlockStack | None:
    """The ModuleList of same-class modules holding the most parameters, or None if there is none."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        classes = {type(child) for child in module._modules.values()}
        if len(classes) != 1:
            continue
        size = num_params(module)
        if size > 0 and (best is None or size > best[0]):
            best = (size, name, module)
    if best is None:
        return None
    return BlockStack(prefix=best[1], blocks=best[2])
