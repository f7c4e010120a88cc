"""LoRA adapters (peft) on projections that tensor parallelism splits, as Megatron's LoRA splits them.

A peft ``lora.Linear`` wraps the projection (``base_layer``) and adds ``lora_B(lora_A(dropout(x))) * scaling``
to its output. The base layer is split as the projection would be; each adapter pair follows it so that the sum
has the base output's layout on every rank:

- column split (by output features): ``lora_A`` whole on the (replicated) input, ``lora_B`` split by its outputs
  like the base layer (with the same packing for a fused projection). ``lora_B``'s column split sums its input
  gradient over the ranks, so ``lora_A`` gets its full gradient, the same on every rank.
- row split (by input features): ``lora_A`` split by its inputs like the base layer, its rank-``r`` output summed
  over the ranks; ``lora_B`` whole on that sum. Its output is cut as the base layer's is reduce-scattered: to this
  rank's tokens under sequence parallelism, to this rank's heads for a projection onto heads (Doge's ``dt_proj``).

Adapter variants with parameters of their own beside A and B (DoRA's magnitude vector) are refused. The split
itself is ``styles.SplitLinear`` applied to a LoRA layer.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["check_lora", "is_lora", "lora_parameter_names", "refuse_in_mixer"]


def is_lora(module: nn.Module) -> bool:
    """A peft LoRA layer around a projection (``base_layer`` with ``lora_A`` / ``lora_B`` per adapter)."""
    return (
        isinstance(getattr(module, "base_layer", None), nn.Module)
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
    )


def check_lora(module: nn.Module, name: str) -> None:
    """Refuse what the split cannot take: adapter variants with parameters of their own, adapters not Linear."""
    variants = dict(getattr(module, "lora_variant", {}) or {})
    magnitude = getattr(module, "lora_magnitude_vector", None)
    if variants or (isinstance(magnitude, nn.ModuleDict) and len(magnitude)):
        raise ValueError(
            f"LoRA layer '{name}' uses an adapter variant ({sorted(variants) or 'DoRA'}) with parameters beside lora_A"
            " and lora_B, which tensor parallelism does not split. Use plain LoRA (use_dora=False), or train with"
            " pipeline_parallel and/or data parallelism (zero_stage 0-3), which take it as it is."
        )
    for key in module.lora_A:
        if not (isinstance(module.lora_A[key], nn.Linear) and isinstance(module.lora_B[key], nn.Linear)):
            raise ValueError(f"LoRA layer '{name}': adapter '{key}' is not a pair of nn.Linear; it cannot be split.")


def lora_parameter_names(module: nn.Module, name: str) -> list[str]:
    """The split parameters' names of a LoRA layer styled as one projection: the base layer's and lora_B's (column)."""
    return [f"{name}.base_layer"] + [f"{name}.lora_B.{key}" for key in module.lora_B]


def refuse_in_mixer(full: str, module: nn.Module, planned: Callable[[], object]) -> None:
    """Refuse LoRA layers on a state-space or linear-attention mixer (``planned()`` recognises it once they are
    unwrapped): its plan splits and reads its projections' weights by name, which adapters do not follow."""
    wrapped = {n: child for n, child in module.named_children() if is_lora(child)}
    if not wrapped:
        return
    for n, child in wrapped.items():
        setattr(module, n, child.base_layer)
    try:
        mixer = planned()
    finally:
        for n, child in wrapped.items():
            setattr(module, n, child)
    if mixer is not None:
        raise ValueError(
            f"LoRA adapters on {sorted(wrapped)} of '{full}' ({type(module).__name__}), a state-space or"
            " linear-attention mixer: tensor parallelism splits adapters only on attention and MLP projections."
            " Leave the mixer's projections out of target_modules, or fine-tune with pipeline_parallel and/or data"
            " parallelism (zero_stage 0-3), which take them as they are."
        )
