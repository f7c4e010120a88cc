"""Gradient norm over every shard of every parameter, wherever it lives (tp, dp shards, pp stages)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["total_grad_norm", "clip_grad_norm_"]


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
