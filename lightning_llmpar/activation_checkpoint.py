"""Activation checkpointing per block: full, every k-th block, or op-level selective.

Configured as a callback (so it fits in a LightningCLI YAML) but applied by the strategy between
tensor parallelism and FSDP: Lightning has no hook between ``configure_model`` and sharding, and
recomputation must replay the tensor-parallel ops while FSDP's hooks stay outside it. Blocks keep their
names: the block's ``forward`` is wrapped in place instead of wrapping the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, get_args

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_llmpar.structure import find_block_stack

__all__ = ["ActivationCheckpointing", "CheckpointPlan", "apply_activation_checkpointing", "saved_activation_bytes"]

Mode = Literal["none", "full", "every_k", "selective"]
Save = Literal["attention", "attention_and_matmuls"]

_ATTENTION = {
    name
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
}
_MATMUL = {"mm", "addmm", "bmm", "linear"}


@dataclass(frozen=True)
class CheckpointPlan:
    mode: Mode = "none"
    every: int = 2
    save: Save = "attention"

    def __post_init__(self) -> None:
        if self.mode not in get_args(Mode):
            raise ValueError(f"activation checkpointing mode={self.mode!r} is not one of {get_args(Mode)}.")
        if self.save not in get_args(Save):
            raise ValueError(f"activation checkpointing save={self.save!r} is not one of {get_args(Save)}.")
        if self.every < 1:
            raise ValueError(f"activation checkpointing every={self.every} must be at least 1.")


def _policy(save: Save) -> Any:
    keep = set(_ATTENTION) | (_MATMUL if save == "attention_and_matmuls" else set())

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = getattr(op, "__name__", str(op)).split(".")[0]
        return CheckpointPolicy.MUST_SAVE if name in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpointed(forward: Any, plan: CheckpointPlan, *args: Any, **kwargs: Any) -> Any:
    if plan.mode == "selective":
        context = partial(create_selective_checkpoint_contexts, _policy(plan.save))
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(blocks: list[nn.Module], plan: CheckpointPlan) -> int:
    """Wrap the ``forward`` of the chosen blocks; returns how many were wrapped."""
    wrapped = 0
    for index, block in enumerate(blocks):
        if plan.mode == "none" or (plan.mode == "every_k" and index % plan.every):
            continue
        block.forward = partial(_checkpointed, block.forward, plan)  # type: ignore[method-assign]
        wrapped += 1
    return wrapped


class ActivationCheckpointing(Callback):
    """Recompute activations in backward instead of keeping them.

    Args:
        mode: 'full' (every block), 'every_k' (every ``every``-th block), 'selective' (every block, keeping
            the outputs of the ops named by ``save`` and recomputing the rest), or 'none'.
        every: the k of 'every_k'.
        save: for 'selective': 'attention' (keep attention outputs) or 'attention_and_matmuls'.

    With LLMParallelStrategy the strategy applies it at the right point of parallelization; with any other
    strategy the callback applies it itself in ``setup``.
    """

    def __init__(self, mode: Mode = "full", every: int = 2, save: Save = "attention") -> None:
        self.plan = CheckpointPlan(mode, every, save)
        self.applied = False

    def apply(self, module: nn.Module) -> None:
        if self.applied:
            return
        stack = find_block_stack(module)
        if stack is None:
            raise ValueError(
                f"Activation checkpointing works per block; no stack of blocks (an nn.ModuleList of identical"
                f" modules) was found in {type(module).__name__}."
            )
        apply_activation_checkpointing(stack.modules(), self.plan)
        self.applied = True

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from lightning_llmpar.strategy import LLMParallelStrategy

        if not isinstance(trainer.strategy, LLMParallelStrategy):
            self.apply(pl_module)


def saved_activation_bytes(fn: Any, *args: Any) -> int:
    """Bytes of the tensors autograd keeps for backward while running ``fn(*args)`` (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return sum(seen.values())
