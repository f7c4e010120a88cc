"""Which kernels the optimizers a LightningModule builds run on: torch's fused Adam/AdamW where they can, as
torchtitan and Megatron train, and never a kernel that cannot take the group's parameters.

torch picks an optimizer's implementation at each step when the user leaves ``foreach`` and ``fused`` unset:
the per-tensor loop on CPU, ``foreach`` on GPUs. Two consequences for a parallelized model:

- The fused kernel updates a tensor in one pass with the same arithmetic (on 2 CPU cores, AdamW over the example
  GPT's 10.8M parameters: 7 ms instead of 34 ms for the loop) and takes DTensor parameters (tensor-parallel
  and FSDP2 shards, on one or several meshes). Adam/AdamW groups left to torch are switched to it.
- ``foreach`` and fused kernels refuse a list that mixes plain tensors and DTensors, which tensor parallelism
  without FSDP2 leaves (a norm outside the plan stays a plain tensor). On GPUs torch would pick ``foreach`` for
  such a group and fail at the first step. Such an Adam/AdamW group is stepped as two fused lists, its DTensors
  and its plain tensors, split for the step only (:class:`_FusedByKind`): the user's groups, learning-rate
  schedules and checkpoints see one group. Other optimizers' mixed groups run the loop; a user's explicit
  ``foreach=True`` / ``fused=True`` on one is refused before training.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.optimizer import _get_fused_kernels_supported_devices

__all__ = ["apply_optimizer_kernels", "group_kernels", "keep_kernels"]

# Exact types: a subclass may override ``step`` with its own arithmetic. SGD's fused kernel has no DTensor rule.
_FUSABLE = (torch.optim.Adam, torch.optim.AdamW)


def apply_optimizer_kernels(optimizers: Iterable[Optimizer], module: nn.Module, fused: bool = True) -> dict[str, int]:
    """Set each parameter group's kernel; returns how many groups were switched to ``fused``, to fused per tensor
    kind (``split``) and to the loop."""
    names = {id(p): n for n, p in module.named_parameters()}
    counts = {"fused": 0, "split": 0, "loop": 0}
    for optimizer in optimizers:
        _refuse_sharded(optimizer, names)
        split = set()
        for index, group in enumerate(optimizer.param_groups):
            chosen = bool(group.get("foreach")) or bool(group.get("fused"))
            fusable = fused and type(optimizer) in _FUSABLE and _fusable(group)
            if _mixed(group["params"]):
                if chosen:
                    raise ValueError(_mixed_message(optimizer, group, names))
                if "foreach" in group:  # a torch optimizer: the loop runs this group whenever it is not split
                    group["foreach"] = False
                    if fusable:
                        split.add(index)
                    counts["split" if fusable else "loop"] += 1
            elif fusable:
                group["fused"] = True
                counts["fused"] += 1
        by_kind = getattr(optimizer, "_llmpar_fused_by_kind", None)
        if by_kind is not None:  # set up again: one pair of hooks per optimizer
            by_kind.indices = split
        elif split:
            _FusedByKind(optimizer, split)
    return counts


def group_kernels(optimizer: Optimizer) -> list[str]:
    """The kernel each parameter group runs: 'fused', 'fused per tensor kind', 'foreach', 'loop' or 'torch's choice'."""
    split = _split_indices(optimizer)
    names = []
    for index, group in enumerate(optimizer.param_groups):
        if index in split:
            names.append("fused per tensor kind")
        elif group.get("fused"):
            names.append("fused")
        elif group.get("foreach") is None:
            names.append("torch's choice")
        else:
            names.append("foreach" if group["foreach"] else "loop")
    return names


class _FusedByKind:
    """Steps each mixed group (plain tensors and DTensors) as two fused groups, one per kind, during ``step`` only.

    The split groups share the group's hyperparameters as they are at that step (a schedule's learning rate
    included); optimizer state is keyed by parameter, so it is the same state either way. Between steps
    ``param_groups`` is the user's list, so schedulers, ``state_dict`` and checkpoints never see the split.
    """

    def __init__(self, optimizer: Optimizer, indices: set[int]) -> None:
        self.indices = indices
        self.saved: list[dict[str, Any]] | None = None
        optimizer._llmpar_fused_by_kind = self  # type: ignore[attr-defined]
        optimizer.register_step_pre_hook(self.split)
        optimizer.register_step_post_hook(self.restore)

    def split(self, optimizer: Optimizer, *_: Any) -> None:
        self.restore(optimizer)  # a step that raised left its split in place
        self.saved = optimizer.param_groups
        groups = []
        for index, group in enumerate(self.saved):
            if index not in self.indices:
                groups.append(group)
                continue
            for sharded in (True, False):
                params = [p for p in group["params"] if isinstance(p, DTensor) is sharded]
                if params:
                    groups.append({**group, "params": params, "fused": True, "foreach": False})
        optimizer.param_groups = groups

    def restore(self, optimizer: Optimizer, *_: Any) -> None:
        if self.saved is not None:
            optimizer.param_groups, self.saved = self.saved, None


@contextmanager
def keep_kernels(optimizers: list[Optimizer]) -> Iterator[None]:
    """Loading a checkpoint restores its parameter groups, kernel flags included (a one-process checkpoint has
    none): the kernels stay this run's choice. Fused kernels keep the step count on the parameters' device."""
    before = [[(g.get("fused"), g.get("foreach")) for g in opt.param_groups] for opt in optimizers]
    yield
    for optimizer, kernels in zip(optimizers, before):
        split = _split_indices(optimizer)
        for index, (group, (fused, foreach)) in enumerate(zip(optimizer.param_groups, kernels)):
            if "fused" in group:
                group["fused"], group["foreach"] = fused, foreach
            for p in group["params"] if fused or index in split else []:
                state = optimizer.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


# Optimizers whose step fails on DTensor parameters (torch.optim.Adafactor's in-place ops on a norm's partial
# placement, with or without foreach): refused before the first step rather than failing inside it.
_NOT_ON_DTENSORS = (torch.optim.Adafactor,)


def _refuse_sharded(optimizer: Optimizer, names: dict[int, str]) -> None:
    if not isinstance(optimizer, _NOT_ON_DTENSORS):
        return
    sharded = next((names.get(id(p), "?") for g in optimizer.param_groups for p in g["params"]
                    if isinstance(p, DTensor)), None)
    if sharded is not None:
        raise ValueError(
            f"{type(optimizer).__name__} cannot step sharded parameters (DTensors such as '{sharded}', made by"
            " tensor parallelism, zero_stage >= 1 or context parallelism): torch's step fails on them. Use AdamW"
            " (or another torch optimizer that takes DTensors), or train with layouts that keep parameters whole:"
            " pipeline_parallel, and data parallelism with zero_stage=0."
        )


def _split_indices(optimizer: Optimizer) -> set[int]:
    """The groups :class:`_FusedByKind` steps per tensor kind."""
    return getattr(getattr(optimizer, "_llmpar_fused_by_kind", None), "indices", set())


def _mixed(params: list[torch.Tensor]) -> bool:
    return len({isinstance(p, DTensor) for p in params}) > 1


def _fusable(group: dict[str, Any]) -> bool:
    if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
        return False  # the user chose an implementation (or needs the differentiable loop)
    devices = _get_fused_kernels_supported_devices()
    params = group["params"]
    return bool(params) and all(p.is_floating_point() and p.device.type in devices for p in params)


def _mixed_message(optimizer: Optimizer, group: dict[str, Any], names: dict[int, str]) -> str:
    plain = next(names.get(id(p), "?") for p in group["params"] if not isinstance(p, DTensor))
    sharded = next(names.get(id(p), "?") for p in group["params"] if isinstance(p, DTensor))
    kernel = "fused=True" if group.get("fused") else "foreach=True"
    return (
        f"{type(optimizer).__name__}({kernel}) steps a parameter group holding both plain tensors (e.g. '{plain}')"
        f" and DTensor shards (e.g. '{sharded}'), which torch's {kernel.split('=')[0]} kernels cannot take in one"
        " call. Leave foreach and fused unset (LLMParallelStrategy then runs the loop on this group), set"
        f" foreach=False, or put the plain parameters in a group of their own."
    )
