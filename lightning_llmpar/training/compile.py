"""``torch.compile`` per block, as torchtitan does: each repeated block is compiled in place (the same code, so the
blocks share one compiled graph), after activation checkpointing has wrapped it and before FSDP2 registers its
hooks (which run outside the compiled region).

Under tensor parallelism the block's ``forward`` is compiled instead, with its sub-modules' DTensor hooks, and
before checkpointing wraps it: torch cannot trace a checkpoint of DTensor code. The same holds for blocks whose graph
breaks on purpose: context-parallel attention and routed experts run eagerly between compiled parts (their
collectives have data-dependent sizes or process-group calls that are not traced). What else does not survive
tracing is handled here: a block input that is a view of a DTensor's local tensor (what an eager ``to_local``,
such as the sharded embedding's, hands over), whose gradient the compiled graph would hand back to that DTensor's
autograd node as a plain tensor; symbolic shapes; and per-rank dropout streams, which reseed torch's generator
between ops, so compiled blocks under tensor parallelism must not drop anything."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.dropout import _DropoutNd

from lightning_llmpar.modeling.structure import BlockStack, find_block_stack

__all__ = ["apply_compile", "check_no_dropout"]

_DROPOUT_NAMES = ("dropout", "pdrop")  # attributes models keep their dropout rates in


def _find_stack(model: nn.Module) -> BlockStack:
    stack = find_block_stack(model)
    if stack is None:
        raise ValueError(
            f"compile=True compiles each block of the model's block stack, but {type(model).__name__} has no"
            " nn.ModuleList, nn.ModuleDict or nn.Sequential of repeated blocks (see docs/model-convention.md). Set block_stack='...'"
            " to name it, or compile=False."
        )
    return stack


def _dropout_rates(module: nn.Module) -> dict[str, float]:
    # The module's own attributes only: configs also carry rates of heads the model does not run (GPT-2's
    # summary_first_dropout), while models copy the rates their blocks use onto the modules.
    rates = {"p": module.p} if isinstance(module, _DropoutNd) else {}
    for name, value in vars(module).items():
        if isinstance(value, float) and any(key in name.lower() for key in _DROPOUT_NAMES):
            rates[name] = value
    return {name: rate for name, rate in rates.items() if rate > 0}


def check_no_dropout(model: nn.Module) -> None:
    """Refuse compiled blocks with dropout under tensor parallelism: ranks holding different heads or tokens
    need their own dropout masks, drawn from per-rank streams that compiled code cannot switch to."""
    stack = _find_stack(model)
    found = [
        f"{name}.{attr}={rate}"
        for prefix, block in zip(stack.names(), stack.modules())
        for name, module in block.named_modules(prefix=prefix)
        for attr, rate in _dropout_rates(module).items()
    ]
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ValueError(
            f"compile=True with tensor_parallel cannot give each rank its own dropout masks, and this model's blocks"
            f" drop activations ({shown}). Set those dropout rates to 0 (as LLM pretraining does), or use"
            " compile=False with tensor_parallel."
        )


def _own_views(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` with tensor arguments that are views (of a DTensor's local tensor, say) copied first."""

    def run(*args: Any, **kwargs: Any) -> Any:
        def own(a: Any) -> Any:
            return a.clone() if isinstance(a, Tensor) and a.requires_grad and a._is_view() else a

        return call(*(own(a) for a in args), **{k: own(v) for k, v in kwargs.items()})

    return run


def apply_compile(model: nn.Module, forward_only: bool = False, static_shapes: bool = False) -> int:
    """Compile every block of ``model``'s block stack in place; returns how many were compiled.

    ``forward_only``: compile each block's ``forward``, to be called before checkpointing wraps the block. Blocks
    whose code does not trace in one graph need it (tensor-parallel DTensor code, context-parallel attention,
    routed experts): torch traces a checkpoint whole or not at all, so a checkpointed block with a graph break
    would run eagerly. ``static_shapes``: a new shape compiles a graph of its own (DTensor code traced with
    symbolic shapes overflows the tracer's recursion, torch 2.13)."""
    blocks = _find_stack(model).modules()
    for block in blocks:
        if forward_only:
            # Only forward: the block's own hooks (its tensor-parallel entry and exit) run eagerly around it.
            block.forward = _own_views(torch.compile(block.forward, dynamic=False if static_shapes else None))
        else:
            block.compile()
    return len(blocks)
