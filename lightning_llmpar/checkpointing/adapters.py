"""LoRA adapters (peft) folded into the weights they adapt, so that an export loads with plain ``from_pretrained``.

peft renames what it wraps (``q_proj.weight`` becomes ``q_proj.base_layer.weight`` beside ``lora_A`` and ``lora_B``);
saved as named, ``from_pretrained`` finds none of those projections and initializes them at random, with a report
but no error. The export holds what the trained model computes instead: ``W + scaling * B @ A`` for every active,
not yet merged adapter (peft's ``merge_and_unload``), and modules peft trains whole (``modules_to_save``) under their
own names. Adapter kinds whose folding is not that sum are refused.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["fold_adapters"]


def fold_adapters(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (keys as transformers names ``model``'s tensors; the modules this rank holds) without peft's names."""
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            _fold_lora(module, prefix, state)
        elif hasattr(module, "modules_to_save") and hasattr(module, "original_module"):
            _unwrap_saved(module, prefix, state)
    left = [k for k in state if any(part in k for part in (".lora_", ".base_layer.", ".modules_to_save.", ".original_module."))]
    if left:
        raise ValueError(f"save_hf_checkpoint cannot fold these adapter tensors into the model's weights: {left[:4]}."
                         " Merge the adapters yourself first (peft: merge_and_unload()), or save them with peft.")
    return state


def _active(module: nn.Module) -> list[str]:
    if getattr(module, "disable_adapters", False):
        return []
    merged = set(getattr(module, "merged_adapters", []))  # already in the base weight
    active = getattr(module, "active_adapters", None) or [getattr(module, "active_adapter", "default")]
    return [a for a in ([active] if isinstance(active, str) else active) if a not in merged]


def _fold_lora(module: nn.Module, prefix: str, state: dict[str, Tensor]) -> None:
    if f"{prefix}base_layer.weight" not in state:
        return  # not among the tensors given
    refused = [what for what, found in (
        ("DoRA", any(getattr(module, "use_dora", {}).values())),
        ("adapters on embeddings", len(getattr(module, "lora_embedding_A", {})) > 0),
        ("fan_in_fan_out (Conv1D) layers", getattr(module, "fan_in_fan_out", False)),
        ("adapters with a bias", any(f"{prefix}lora_B.{a}.bias" in state for a in module.lora_A)),
        (f"a {type(module.base_layer).__name__} base layer", not isinstance(module.base_layer, nn.Linear)),
    ) if found]
    if refused:
        raise ValueError(f"save_hf_checkpoint folds LoRA adapters into nn.Linear weights only; {prefix[:-1]} has"
                         f" {', '.join(refused)}. Merge the adapters yourself first (peft: merge_and_unload()).")
    weight = state.pop(f"{prefix}base_layer.weight")
    folded = weight.float()
    active = _active(module)
    for adapter in list(module.lora_A):
        a, b = state.pop(f"{prefix}lora_A.{adapter}.weight"), state.pop(f"{prefix}lora_B.{adapter}.weight")
        if adapter in active:
            folded = folded + module.scaling[adapter] * (b.float() @ a.float())
    state[f"{prefix}weight"] = folded.to(weight.dtype)
    _rename(state, f"{prefix}base_layer.", prefix)


def _unwrap_saved(module: nn.Module, prefix: str, state: dict[str, Tensor]) -> None:
    active = _active(module)
    chosen = f"{prefix}modules_to_save.{active[0]}." if active and active[0] in module.modules_to_save else None
    source = chosen or f"{prefix}original_module."
    for key in [k for k in state if k.startswith((f"{prefix}modules_to_save.", f"{prefix}original_module."))]:
        if not key.startswith(source):
            del state[key]
    _rename(state, source, prefix)


def _rename(state: dict[str, Tensor], old: str, new: str) -> None:
    """Keys starting with ``old`` start with ``new`` instead."""
    for key in [k for k in state if k.startswith(old)]:
        state[new + key[len(old):]] = state.pop(key)

