"""Gradient norm over every shard of every parameter, wherever it lives (tp, dp shards, pp stages)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "grad_norm", "stages_of", "total_grad_norm"]


def total_grad_norm(
    parameters: Iterable[Tensor],
    norm_type: float = 2.0,
    stage_group: dist.ProcessGroup | None = None,
    skip: Collection[int] = (),
    device: torch.device | None = None,
) -> Tensor:
    """The norm single-process training would compute over all gradients.

    DTensor reductions know which placements hold partial data, but ``torch.stack`` refuses
    DTensors on different meshes (TP params live on dp x tp, norms on dp only), so each
    (mesh, placements) group is reduced on its own and the results combined as plain tensors.
    ``stage_group`` adds the parameters other pipeline stages hold; every rank of it must call this,
    also one whose stage has no gradient at all (frozen layers). ``skip``: ids of parameters that are
    copies of a weight counted elsewhere (tied weights on several pipeline stages).
    """
    norm_type = float(norm_type)
    groups: dict[object, list[Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is None or id(p) in skip:
            continue
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups[key].append(g)
    partial: list[Tensor] = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        partial.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if partial:
        total = torch.nn.utils.get_total_norm(partial, norm_type)
    else:
        total = torch.zeros((), device=device or torch.device("cpu"))
    if stage_group is not None and dist.get_world_size(stage_group) > 1:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=stage_group)
        else:
            total = total.pow(norm_type)
            dist.all_reduce(total, group=stage_group)
            total = total.pow(1.0 / norm_type)
    return total


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    stage_group: dist.ProcessGroup | None = None,
    skip: Collection[int] = (),
    device: torch.device | None = None,
) -> Tensor:
    """Scale all gradients so their global norm is at most ``max_norm``; returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, norm_type, stage_group, skip, device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grad.mul_(coef.to(grad.device, grad.dtype))
    return total


def stages_of(strategy: Any) -> tuple[dist.ProcessGroup | None, Collection[int]]:
    """The pipeline group a norm adds the other stages' parameters over, and the ids of tied copies it skips
    (``total_grad_norm``'s ``stage_group`` and ``skip``); (None, ()) without pipeline parallelism."""
    runner = getattr(strategy, "pipeline_runner", None)
    if runner is None:
        return None, ()
    return runner.pp_group, runner.ties.duplicates() if runner.ties is not None else ()


def grad_norm(module: Any, norm_type: float | str = 2.0, group_separator: str = "/") -> dict[str, Tensor]:
    """Lightning's ``grad_norm`` (``lightning.pytorch.utilities.grad_norm``: the same keys) with the values one
    process logs, under every layout: each parameter's norm over its whole gradient (DTensor shards reduced, every
    pipeline stage's parameters) and the total (a weight tied across stages counted once). Lightning's own fails on
    DTensor gradients and, under pipeline parallelism, sees only the rank's stage. Call it on every rank, where
    Lightning's is called (``on_before_optimizer_step``): it communicates."""
    norm_type = float(norm_type)
    stage_group, skip = stages_of(module.trainer.strategy)
    norms: dict[str, float] = {}
    for name, p in module.named_parameters():
        if p.grad is not None and id(p) not in skip:
            norm = torch.linalg.vector_norm(p.grad, norm_type)
            norms[f"grad_{norm_type}_norm{group_separator}{name}"] = float(
                norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if stage_group is not None:  # the other stages' parameters
        stages: list[dict[str, float]] = [{} for _ in range(dist.get_world_size(stage_group))]
        dist.all_gather_object(stages, norms, group=stage_group)
        norms = {k: v for stage in stages for k, v in stage.items()}
    result = {k: torch.tensor(v) for k, v in norms.items()}
    if result:  # as Lightning's: the norm of the parameters' norms
        result[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return result
