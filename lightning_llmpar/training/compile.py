"""``torch.compile`` per block, as torchtitan does: each repeated block is compiled in place (the same code, so the
blocks share one compiled graph), after tensor parallelism and activation checkpointing have wrapped it and
before FSDP2 registers its hooks (which run outside the compiled region)."""

from __future__ import annotations

from torch import nn

from lightning_llmpar.modeling.structure import find_block_stack

__all__ = ["apply_compile"]


def apply_compile(model: nn.Module) -> int:
    """Compile every block of ``model``'s block stack in place; returns how many were compiled."""
    stack = find_block_stack(model)
    if stack is None:
        raise ValueError(
            f"compile=True compiles each block of the model's block stack, but {type(model).__name__} has no"
            " nn.ModuleList of repeated blocks (see docs/model-convention.md). Set block_stack='...' to name it, or"
            " compile=False."
        )
    blocks = stack.modules()
    for block in blocks:
        block.compile()
    return len(blocks)
