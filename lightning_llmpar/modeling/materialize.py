"""Models built on the meta device get real memory only for what each rank holds, after parallelization.

``to_empty`` allocates every rank's shards; then each module initializes itself: transformers models through
their own ``initialize_weights`` (which also recomputes buffers that are not in checkpoints, such as rotary
frequencies and embedding scales), any other module through ``reset_parameters``. Pretrained weights, if
any, are loaded afterwards (see ``hf_checkpoint``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from lightning_llmpar.modeling.head_counts import whole_counts
from lightning_llmpar.modeling.packing import Packing, to_packed
from lightning_llmpar.modeling.structure import is_transformers
from lightning_llmpar.modeling.ties import TiedWeight, retie

__all__ = ["has_meta_tensors", "materialize", "pretrained_models"]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def pretrained_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost transformers ``PreTrainedModel`` instances inside ``module``, with their names."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if is_transformers(sub, "PreTrainedModel") and not any(name.startswith(f + ".") or f == "" for f, _ in found):
            found.append((name, sub))
    return found


class _WholeValuesIntoShards(TorchFunctionMode):
    """Init code that copies a whole tensor into a parameter (transformers: ``A_log = log(arange(heads))``) meets a
    DTensor shard here: each rank takes its part of the whole value (in the packed order of a fused parameter)."""

    def __init__(self, packings: Mapping[int, Packing]) -> None:
        super().__init__()
        self.packings = packings

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) >= 2:
            dst, src = args[0], args[1]
            if isinstance(dst, DTensor) and not isinstance(src, DTensor) and src.shape == dst.shape:
                packing = self.packings.get(id(dst))
                whole = to_packed(src.to(dst.device), packing) if packing is not None else src.to(dst.device)
                src = distribute_tensor(whole, dst.device_mesh, dst.placements, src_data_rank=None)
                return func(dst, src, *args[2:], **kwargs)
        return func(*args, **kwargs)


@torch.no_grad()
def materialize(
    module: nn.Module, device: torch.device, tied: Sequence[TiedWeight] = (), packings: Mapping[str, Packing] | None = None
) -> bool:
    """Allocate and initialize a module whose tensors are (partly) on the meta device; False if none were.
    ``packings``: the fused parameters' layouts, by name."""
    if not has_meta_tensors(module):
        return False
    module.to_empty(device=device)
    retie(module, tied)  # to_empty gives every parameter new memory, one per name
    hf = pretrained_models(module)
    covered: set[int] = set()
    by_id = {id(p): packings[n] for n, p in module.named_parameters() if packings and n in packings}
    for _, model in hf:
        for sub in model.modules():
            sub.__dict__.pop("_is_hf_initialized", None)  # initialize_weights skips modules flagged done
            for t in itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False)):
                t.__dict__.pop("_is_hf_initialized", None)
        with whole_counts(model), _WholeValuesIntoShards(by_id):
            model.initialize_weights()
        covered.update(id(sub) for sub in model.modules())
    missing = set()
    for sub in module.modules():
        if id(sub) in covered or not any(True for _ in itertools.chain(sub.parameters(False), sub.buffers(False))):
            continue
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            missing.add(type(sub).__name__)
    if missing:
        rank_zero_warn(
            "These modules were built on the meta device but define no reset_parameters(), so their tensors hold"
            f" uninitialized memory unless a checkpoint fills them: {', '.join(sorted(missing))}."
        )
    return True
