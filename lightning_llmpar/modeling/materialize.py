"""Models built on the meta device get real memory only for what each rank holds, after parallelization.

``to_empty`` allocates every rank's shards; then each module initializes itself: transformers models through
their own ``initialize_weights`` (which also recomputes buffers that are not in checkpoints, such as rotary
frequencies and embedding scales), any other module through ``reset_parameters``. Pretrained weights, if
any, are loaded afterwards (see ``hf_checkpoint``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_llmpar.modeling.ties import TiedWeight, retie

__all__ = ["has_meta_tensors", "materialize", "pretrained_models"]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def pretrained_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost transformers ``PreTrainedModel`` instances inside ``module``, with their names."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel) and not any(name.startswith(f + ".") or f == "" for f, _ in found):
            found.append((name, sub))
    return found


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, tied: Sequence[TiedWeight] = ()) -> bool:
    """Allocate and initialize a module whose tensors are (partly) on the meta device; False if none were."""
    if not has_meta_tensors(module):
        return False
    module.to_empty(device=device)
    retie(module, tied)  # to_empty gives every parameter new memory, one per name
    hf = pretrained_models(module)
    covered: set[int] = set()
    for _, model in hf:
        for sub in model.modules():
            sub.__dict__.pop("_is_hf_initialized", None)  # initialize_weights skips modules flagged done
            for t in itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False)):
                t.__dict__.pop("_is_hf_initialized", None)
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
