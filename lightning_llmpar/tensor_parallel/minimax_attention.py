"""Tensor parallelism for lightning attention (MiniMax's linear-attention layers): split by heads.

Each head runs its own recurrence over the sequence with its own decay rate, so a rank keeps its heads' rows of
``qkv_proj`` (grouped per head: [q_h; k_h; v_h]) and ``output_gate``, and its heads' columns of ``out_proj``.
The decay tables are buffers with one entry per head, saved with the weights: they stay whole in the module
(initialized, saved and loaded whole) and the layer's code sees its heads' part. The norm over every head's
features is split with them, its statistic reduced over the ranks (DTensor).
"""

from __future__ import annotations

from torch import nn

from lightning_llmpar.modeling.packing import Packing
from lightning_llmpar.tensor_parallel.entries import has_params
from lightning_llmpar.tensor_parallel.entries import join as _join
from lightning_llmpar.tensor_parallel.param_styles import ShardedNorm
from lightning_llmpar.tensor_parallel.ssm import MixerParams, MixerPlan, divisible_heads, linears, region

__all__ = ["plan_minimax_attention"]

_PARTS = ("qkv_proj", "output_gate", "out_proj")


def plan_minimax_attention(full: str, module: nn.Module, tp: int, seq: bool) -> MixerPlan | None:
    """The plan of ``module`` if it is a lightning attention (``qkv_proj``, ``output_gate``, ``out_proj`` and a
    ``slope_rate`` decay buffer), else None."""
    heads = getattr(module, "num_attention_heads", None)
    if not linears(module, *_PARTS) or "slope_rate" not in module._buffers:
        return None
    norm = getattr(module, "norm", None)
    others = [n for n, c in module.named_children()
              if n not in _PARTS and c is not norm and has_params(c, recurse=True)]
    if not isinstance(heads, int) or others or has_params(module):
        raise ValueError(
            f"'{full}' ({type(module).__name__}) is a lightning attention with parts tensor parallelism does not know"
            f" how to split by heads ({others or 'its own parameters'}). Train this model with pipeline_parallel"
            " and/or zero_stage, which take it as it is, or without tensor parallelism."
        )
    divisible_heads(full, module, heads, tp)
    buffers: dict[str, Packing] = {}
    for name, buffer in module.named_buffers(recurse=False):
        dims = [d for d, size in enumerate(buffer.shape) if size == heads]
        if len(dims) != 1:
            raise ValueError(
                f"'{full}' ({type(module).__name__}): buffer '{name}' of shape {tuple(buffer.shape)} has no single"
                f" dimension of its {heads} heads, so its per-head part cannot be found. Train this model without"
                " tensor parallelism."
            )
        buffers[name] = Packing(dims[0], (heads,), tp)
    plan = region(full, module, {"qkv_proj": None, "output_gate": None}, "out_proj", seq)
    plan.counts[full] = {"num_attention_heads": heads // tp}
    if norm is not None and has_params(norm, recurse=True):
        plan.styles[_join(full, "norm")] = ShardedNorm()
    plan.styles[f"{full}#params"] = MixerParams({}, (), buffers, "out_proj")
    return plan
