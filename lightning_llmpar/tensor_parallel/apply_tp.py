"""Apply a tensor-parallel plan: shard each module, then give attention code its per-rank head counts."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
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
    _styles_first(users)
    if rank_streams:
        apply_rank_streams(model, plan.rank_streams, tp_mesh.get_local_rank(), plan.replicated_dropout)
    set_local_counts(model, plan.local_counts)
    return model



def _styles_first(users: dict[nn.Module, set[int]]) -> None:
    """Run the forward hooks the styles added before those the model had (``users``: each module's hook ids before
    sharding). A style's hook makes the module's output what the next module takes: a row split's sum over ranks
    (its output is a partial sum until then, on which a user's dropout or GELU on the embedding crashed), a column
    split's local shard. The user's hooks then see the output the model goes on with."""
    for module, before in users.items():
        added = [key for key in module._forward_hooks if key not in before]
        for key in reversed(added):
            module._forward_hooks.move_to_end(key, last=False)
