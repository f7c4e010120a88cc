"""Apply a tensor-parallel plan: shard each module, then give attention code its per-rank head counts."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import parallelize_module

from lightning_llmpar.modeling.head_counts import set_local_counts
from lightning_llmpar.tensor_parallel.plan import TPPlan
from lightning_llmpar.tensor_parallel.rng import apply_rank_streams

__all__ = ["apply_tensor_parallel"]


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan, rank_streams: bool = True) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` following ``plan`` (see :func:`infer_tp_plan`). ``rank_streams=False``
    leaves out the per-rank dropout streams (for models that drop nothing)."""
    users = {m: set(m._forward_hooks) for m in model.modules() if m._forward_hooks}
    # Keys may carry a '#tag' when one module gets several styles (e.g. a block's input preparation and,
    # separately, its output gathering): apply each on its own. Order is the plan's, the same on every
    # rank: sharding a parameter is a collective.
    for key, style in plan.styles.items():
        if style is None:
            continue
        name = key.split("#", 1)[0]
        parallelize_module(model.get_submodule(name) if name else model, tp_mesh, style)
    _sums_first(users)
    _support_anomaly_checks()
    if rank_streams:
        apply_rank_streams(model, plan.rank_streams, tp_mesh.get_local_rank(), plan.replicated_dropout)
    set_local_counts(model, plan.local_counts)
    return model


@cache  # registered once per process
def _support_anomaly_checks() -> None:
    """Let ``detect_anomaly`` check DTensor gradients. Anomaly mode asks whether a gradient has a NaN with
    ``aten._is_any_true``, which DTensor has no rule for (Trainer(detect_anomaly=True) failed at the first backward
    under tensor parallelism); its rule here: on the whole tensor, every rank gets the answer."""
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.aten._is_any_true.default)
    def _on_the_whole(x: Any) -> list[tuple[list[Any], list[Any]]]:
        return [([Replicate()], [Replicate()])]


def _reduced(_module: nn.Module, _args: Any, output: Any) -> Any:
    if isinstance(output, DTensor) and any(p.is_partial() for p in output.placements):
        return output.redistribute(placements=[Replicate() if p.is_partial() else p for p in output.placements])
    return None


def _sums_first(users: dict[nn.Module, set[int]]) -> None:
    """Reduce a split's partial sums before the forward hooks the model had (``users``: each module's hook ids
    before sharding). A row split's output (the vocabulary-split embedding's) is a partial sum until the style's own
    hook, which runs after the user's: a dropout or a GELU there crashed, and no hook saw the module's output. The
    user's hooks now see it whole, a replicated DTensor with the global shape (NEFTune scales its noise by it); the
    style's hook then shards it as before (sequence parallelism). A column split's output is a sharded DTensor,
    already the module's output."""
    for module, before in users.items():
        if any(key not in before for key in module._forward_hooks):  # a style's hook: the module was split
            module.register_forward_hook(_reduced, prepend=True)
