"""Apply a tensor-parallel plan: shard each module, then give attention code its per-rank head counts."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from lightning_llmpar.tensor_parallel.plan import TPPlan
from lightning_llmpar.tensor_parallel.rng import apply_rank_streams

__all__ = ["apply_tensor_parallel", "whole_counts"]


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan, rank_streams: bool = True) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` following ``plan`` (see :func:`infer_tp_plan`). ``rank_streams=False``
    leaves out the per-rank dropout streams (for models that drop nothing)."""
    # Keys may carry a '#tag' when one module gets several styles (e.g. a block's input preparation and,
    # separately, its output gathering): apply each on its own. Order is the plan's, the same on every
    # rank: sharding a parameter is a collective.
    for key, style in plan.styles.items():
        if style is None:
            continue
        name = key.split("#", 1)[0]
        parallelize_module(model.get_submodule(name) if name else model, tp_mesh, style)
    if rank_streams:
        apply_rank_streams(model, plan.rank_streams, tp_mesh.get_local_rank(), plan.replicated_dropout)
    for name, counts in plan.local_counts.items():
        module = model.get_submodule(name)
        for attr, value in counts.items():
            if attr.startswith("config.") and not getattr(module, "_llmpar_own_config", False):
                module.config = copy.copy(module.config)  # the model's config is shared by every layer
                module._llmpar_own_config = True
            module.__dict__.setdefault(_COUNTS, {})[attr] = (_get(module, attr), value)
            _set(module, attr, value)
    return model


_COUNTS = "_llmpar_counts"  # on a module: attribute -> (the whole model's value, this rank's value)


def _get(module: nn.Module, attr: str) -> Any:
    owner, _, leaf = attr.rpartition(".")
    return getattr(module.config if owner == "config" else module, leaf)


def _set(module: nn.Module, attr: str, value: Any) -> None:
    owner, _, leaf = attr.rpartition(".")
    setattr(module.config if owner == "config" else module, leaf, value)


@contextlib.contextmanager
def whole_counts(model: nn.Module) -> Iterator[None]:
    """The whole model's head counts and widths while code that builds whole tensors from them runs (transformers'
    init: ``A_log = log(arange(1, num_heads + 1))``); this rank's again after."""
    patched = [(m, attr, whole, local) for m in model.modules() for attr, (whole, local) in getattr(m, _COUNTS, {}).items()]
    for module, attr, whole, _ in patched:
        _set(module, attr, whole)
    try:
        yield
    finally:
        for module, attr, _, local in patched:
            _set(module, attr, local)
