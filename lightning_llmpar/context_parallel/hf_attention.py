"""transformers models under context parallelism: attention without a mask, so SDPA sees plain causal attention.

A cut sequence comes with non-contiguous ``position_ids`` (head-tail), from which transformers would infer packed
sequences and build an explicit mask; the ring cannot take one. One registered implementation (transformers'
``AttentionInterface`` / ``AttentionMaskInterface``) keeps transformers' SDPA attention and returns no mask while a
context-parallel step runs, and the usual SDPA mask otherwise (validation runs on whole sequences).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_llmpar.modeling.structure import is_transformers

__all__ = ["ATTENTION_NAME", "prepare_hf_attention"]

ATTENTION_NAME = "llmpar_context_parallel"
_state: dict[str, Callable[[], bool]] = {"active": lambda: False}


def _sliding(config: Any) -> bool:
    # layer_types, where a config has them, say which layers slide (Gemma-2's sliding_window is set even when none
    # does, and its model needs the value).
    layer_types = getattr(config, "layer_types", None) or ()
    if layer_types:
        return any("sliding" in str(t) or "chunked" in str(t) for t in layer_types)
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def _refusal(name: str, config: Any) -> str | None:
    """Why torch's ring and Ulysses attention (SDPA per part) cannot run this model's attention, with the fix."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return (f"context_parallel cannot run {name}'s attention: it caps the attention scores"
                f" (attn_logit_softcapping={config.attn_logit_softcapping}), which torch's ring and Ulysses"
                " attention (SDPA) cannot. Use context_parallel=1 for it (tensor and pipeline parallelism split it"
                " exactly), or attn_logit_softcapping=None for a model trained without the cap.")
    if _sliding(config):
        layer_types = getattr(config, "layer_types", None)
        fix = (f"config.layer_types=['full_attention'] * {len(layer_types)}" if layer_types
               else "config.sliding_window=None")
        return (f"context_parallel cannot cut the sequence of {name}: its attention uses a sliding window"
                f" (sliding_window={getattr(config, 'sliding_window', None)}, layer_types={layer_types}), which"
                f" torch's ring and Ulysses attention do not take. Set {fix} when sequences are no longer than the"
                " window (the same attention then), or use context_parallel=1.")
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*args: Any, **kwargs: Any) -> Any:
        return None if _state["active"]() else sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, sdpa_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, mask)


def prepare_hf_attention(module: nn.Module, active: Callable[[], bool]) -> bool:
    """Switch every transformers model in ``module`` to the mask-free causal attention; True if there was one."""
    models = [m for m in module.modules() if is_transformers(m, "PreTrainedModel")]
    if not models:
        return False
    _state["active"] = active
    _register()
    for model in models:
        name, config = type(model).__name__, model.config
        if (refusal := _refusal(name, config)) is not None:
            raise ValueError(refusal)
        if not model._can_set_attn_implementation():
            raise ValueError(
                f"context_parallel needs {name}'s attention to run through transformers' attention functions"
                " (AttentionInterface), which this model's attention does not use. Use context_parallel=1 for it."
            )
    models[0].set_attn_implementation(ATTENTION_NAME)
    for model in models[1:]:
        model.config._attn_implementation_internal = ATTENTION_NAME
    return True
