"""Attention over a sequence split across context-parallel ranks, in place of ``F.scaled_dot_product_attention``.

- ``ring``: torch's ring attention (``torch.distributed.tensor.experimental``'s templated ring forward and
  backward, with head-tail load balancing for the causal mask). On GPUs the call goes through torch's own
  context-parallel DTensor dispatch; torch registers no ring for the CPU flash kernel, so on CPU the same
  templated ring is bound to ``_scaled_dot_product_flash_attention_for_cpu`` and its backward here.
- ``ulysses``: all-to-all from sequence shards to head shards, full-sequence attention on H / cp heads, and
  back (DeepSpeed-Ulysses), on torch's autograd-aware functional collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

from lightning_llmpar.training.documents import document_causal_mask

__all__ = ["MODES", "context_parallel_attention", "enable_device_ring"]

MODES = ("ring", "ulysses")
_aten = torch.ops.aten


class _CPURingAttention(torch.autograd.Function):
    """torch's templated ring attention on the CPU flash kernel (q, k, v: (B, heads, local seq, head_dim))."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, scale: float | None, group: dist.ProcessGroup) -> Tensor:
        out, lse = torch_cp._templated_ring_attention(
            group, 2, _aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v,
            is_causal=True, dropout_p=0.0, scale=scale,
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group = scale, group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch_cp._templated_ring_attention_backward(
            ctx.group, 2, _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad_out.contiguous(), grad_out_name="grad_out", query=q, key=k, value=v, out=out,
            logsumexp=lse, is_causal=True, dropout_p=0.0, scale=ctx.scale,
        )
        return dq, dk, dv, None, None


def _ring(q: Tensor, k: Tensor, v: Tensor, scale: float | None, mesh: DeviceMesh, sdpa: Callable) -> Tensor:
    if q.device.type == "cpu":
        return _CPURingAttention.apply(q, k, v, scale, mesh.get_group())
    # torch's own path: sequence-sharded DTensors dispatch SDPA to its ring (see enable_device_ring).
    dq, dk, dv = (DTensor.from_local(t.contiguous(), mesh, [Shard(2)], run_check=False) for t in (q, k, v))
    return sdpa(dq, dk, dv, is_causal=True, scale=scale).to_local()


def _seq_to_heads(x: Tensor, group: dist.ProcessGroup, cp: int) -> Tensor:
    # (B, H, S/cp, D) sequence shard -> (B, H/cp, S, D) head shard; chunk j of the sequence came from rank j.
    B, H, s, D = x.shape
    send = x.reshape(B, cp, H // cp, s, D).permute(1, 0, 2, 3, 4).contiguous()
    recv = all_to_all_single_autograd(send.flatten(0, 1), None, None, group)
    return recv.reshape(cp, B, H // cp, s, D).permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * s, D)


def _heads_to_seq(x: Tensor, group: dist.ProcessGroup, cp: int) -> Tensor:
    B, h, S, D = x.shape
    send = x.reshape(B, h, cp, S // cp, D).permute(2, 0, 1, 3, 4).contiguous()
    recv = all_to_all_single_autograd(send.flatten(0, 1), None, None, group)
    return recv.reshape(cp, B, h, S // cp, D).permute(1, 0, 2, 3, 4).reshape(B, cp * h, S // cp, D)


def _ulysses(q: Tensor, k: Tensor, v: Tensor, scale: float | None, mesh: DeviceMesh, sdpa: Callable,
             mask: Tensor | None = None) -> Tensor:
    group, cp = mesh.get_group(), mesh.size()
    if q.shape[1] % cp:
        raise ValueError(
            f"context_parallel_mode='ulysses' splits attention heads over the context-parallel ranks, but this layer"
            f" has {q.shape[1]} query heads (on this rank), not divisible by context_parallel={cp}. Use"
            " context_parallel_mode='ring', or a context_parallel degree that divides the heads."
        )
    q, k, v = (_seq_to_heads(t, group, cp) for t in (q, k, v))
    # Each rank now holds whole sequences (of its heads): packed documents take their mask over the whole sequence.
    out = sdpa(q, k, v, attn_mask=mask, scale=scale) if mask is not None else sdpa(q, k, v, is_causal=True, scale=scale)
    return _heads_to_seq(out, group, cp)


def context_parallel_attention(
    mode: str, mesh: DeviceMesh, sdpa: Callable, query: Tensor, key: Tensor, value: Tensor,
    attn_mask: Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
    enable_gqa: bool = False, documents: Tensor | None = None,
) -> Tensor:
    """``F.scaled_dot_product_attention``'s arguments, on this rank's part of the sequence; causal only, or causal
    within each packed document (``documents``: the whole sequences' document ids, Ulysses only). The model's own
    mask is then its rank's part of that document mask, which the whole one replaces."""
    local = query.shape[-2]
    own_document_mask = documents is not None and (attn_mask is None or tuple(attn_mask.shape[-2:]) == (local, local))
    if (attn_mask is not None or not is_causal) and not own_document_mask or dropout_p:
        raise ValueError(
            "context_parallel runs causal attention over a sequence split across ranks; an attention layer called"
            f" scaled_dot_product_attention with attn_mask={'a tensor' if attn_mask is not None else None},"
            f" is_causal={is_causal}, dropout_p={dropout_p}. Use a causal model without attention masks (padding must"
            " be on the right) and attention dropout 0, or context_parallel=1."
        )
    if key.shape[1] != query.shape[1]:  # grouped-query attention: one k/v head per group of query heads
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if documents is not None:
        mask = document_causal_mask(documents)
        return _ulysses(query, key, value, scale, mesh, sdpa, mask)
    attend = _ring if mode == "ring" else _ulysses
    return attend(query, key, value, scale, mesh, sdpa)


def enable_device_ring() -> None:
    """Let sequence-sharded DTensors reach torch's ring kernels (GPU flash / efficient / cuDNN attention)."""
    torch_cp._enable_cp_dtensor_dispatcher()

