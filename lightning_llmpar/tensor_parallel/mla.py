"""Tensor parallelism for multi-head latent attention (DeepSeek-V2/V3/V3.2, Kimi-K2, MiniCPM3, GLM-4.7-Flash, GLM-5,
Youtu): split by heads, as Megatron splits it.

Each head reads two shared low-rank latents: the query's (``q_a_proj`` -> ``q_a_layernorm``) and the key/value's
(``kv_a_proj_with_mqa``: the compressed key/value, then ``kv_a_layernorm``, and one rotary key slice every head
uses). A rank keeps its heads' rows of the up projections (``q_b_proj``, or ``q_proj`` without a query latent,
and ``kv_b_proj``) and its heads' columns of ``o_proj``; the down projections and the latents' norms run whole
on every rank (Megatron's duplicated down projections). The up projections sum their input's gradient over the
ranks, so the latents get their full gradient there; the rotary key slice goes to this rank's heads directly,
so its gradient is summed on its own (Megatron's "f"), leaving every whole parameter's gradient complete.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_llmpar.modeling.structure import count_attr
from lightning_llmpar.tensor_parallel.entries import has_params
from lightning_llmpar.tensor_parallel.entries import join as _join
from lightning_llmpar.tensor_parallel.ssm import MixerPlan, divisible_heads, linears, region
from lightning_llmpar.tensor_parallel.styles import _identity_forward_sum_backward

__all__ = ["LATENT", "SharedRotaryKey", "plan_mla"]

# The child that marks a multi-head latent attention: it makes the key/value latent and the shared rotary key.
LATENT = "kv_a_proj_with_mqa"
# Its parts that run whole: the down projections to the latents, the latents' norms, and the sparse-attention
# indexer of DeepSeek-V3.2 and GLM-5 (it runs without gradients and picks the same tokens on every rank).
_WHOLE = ("q_a_proj", "q_a_layernorm", LATENT, "kv_a_layernorm", "indexer")
_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


class SharedRotaryKey(ParallelStyle):
    """On ``kv_a_proj_with_mqa``: its last ``width`` outputs (the rotary key every head shares) keep their value
    forward and get their gradient summed over the ranks going back."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            latent, rotary = out.split([out.shape[-1] - self.width, self.width], dim=-1)
            return torch.cat([latent, _identity_forward_sum_backward(rotary, device_mesh)], dim=-1)

        module.register_forward_hook(hook)
        return module


def plan_mla(full: str, module: nn.Module, tp: int, seq: bool) -> MixerPlan | None:
    """The plan of ``module`` if it is a multi-head latent attention made only of the parts above, else None (kept
    whole: per-head gates or sinks besides them are not split)."""
    q = "q_proj" if linears(module, "q_proj") else "q_b_proj"
    heads, rotary = getattr(module, "num_heads", None), getattr(module, "qk_rope_head_dim", None)
    if not linears(module, LATENT, "kv_b_proj", "o_proj", q) or not isinstance(heads, int):
        return None
    parts = {n for n, c in module.named_children() if has_params(c, recurse=True)}
    if not isinstance(rotary, int) or parts - {*_WHOLE, q, "kv_b_proj", "o_proj"} or has_params(module):
        return None
    divisible_heads(full, module, heads, tp)
    plan = region(full, module, {q: None, "kv_b_proj": None}, "o_proj", seq)
    plan.counts[full] = _local_counts(module, heads, tp)
    plan.styles[_join(full, LATENT)] = SharedRotaryKey(rotary)
    return plan


def _local_counts(module: nn.Module, heads: int, tp: int) -> dict[str, Any]:
    counts: dict[str, Any] = {"num_heads": heads // tp}
    config = getattr(module, "config", None)
    for attr in _HEAD_COUNTS:  # code that reshapes with the config's counts sees this rank's (a private copy)
        if (value := count_attr(config, attr)) is not None:
            counts[f"config.{attr}"] = value // tp
    return counts
