"""Complete the partial gradients tensor parallelism leaves, all at once, before anything reads them.

A whole weight applied to activations sharded over the tensor-parallel ranks (a norm under sequence
parallelism, a per-head q/k norm) gets a ``Partial`` gradient from DTensor: each rank holds its tokens' or
heads' share. Left so, every later reader redistributes it on its own (the global-norm clip, then the
optimizer, once per parameter and per use), each a small latency-bound all-reduce. Megatron sums its
sequence-parallel norm gradients in one bucket after backward; this does the same, one all-reduce per mesh,
layout and dtype. FSDP2 completes the gradients it reduces itself, so this finds work only where it does not run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate

__all__ = ["reduce_partial_grads"]


def reduce_partial_grads(parameters: Iterable[Tensor]) -> int:
    """Turn every summed-``Partial`` gradient among ``parameters`` into a ``Replicate`` one, one all-reduce per
    (mesh, placements, dtype) group and partial mesh dim; returns how many gradients were completed."""
    groups: dict[tuple, list[Tensor]] = defaultdict(list)
    for p in parameters:
        g = p.grad
        partial = [pl for pl in g.placements if isinstance(pl, Partial)] if isinstance(g, DTensor) else []
        if partial and all(pl.reduce_op == "sum" for pl in partial):
            groups[(g.device_mesh, g.placements, g.dtype)].append(p)
    for (mesh, placements, _), params in groups.items():
        locals_ = [p.grad.to_local() for p in params]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim, placement in enumerate(placements):
            if isinstance(placement, Partial):
                dist.all_reduce(flat, group=mesh.get_group(dim))
        done = tuple(Replicate() if isinstance(pl, Partial) else pl for pl in placements)
        for p, local, part in zip(params, locals_, flat.split([t.numel() for t in locals_])):
            # Back into each gradient's own storage: a view of `flat` would hold all of it, and a DTensor over a
            # view of a shared buffer cannot be deep-copied (copy.deepcopy of the model, AveragedModel).
            local.copy_(part.view_as(local))
            p.grad = DTensor.from_local(local, mesh, done, run_check=False, shape=p.grad.shape, stride=p.grad.stride())
    return sum(len(v) for v in groups.values())
