"""What one context-parallel rank computes for one attention layer, timed on one device: the flash kernels of
torch's ring attention (``context_parallel``: round-robin load balance, fp32 merging), forward and backward, and
the copies and merges between them, at cp 1-8 for torchtitan's 8B context-parallel runs (32 heads of 128, 32768
tokens per rank). The ring's communication is left out (one device); what is measured is the compute the planner
costs with ``attention_efficiency`` and ``ring_attention_bytes``, next to the planner's figure for it.

The rank emulated is the last one, whose steps all use its whole query with the first half of the keys it
receives (every step the same FLOPs as the first, causal one); its own keys and values stand in for the ones
received, which changes no kernel's work.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu.train import cluster_kind
from lightning_llmpar.planner import Candidate, cluster_from
from lightning_llmpar.planner.kernels import attention_flops, ring_attention_bytes
from lightning_llmpar.planner.spec import ModelSpec

__all__ = ["predicted", "ring_attention", "with_prediction"]

Tensors = tuple[torch.Tensor, ...]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if q.is_cuda:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse


def _flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool) -> Tensors:
    if q.is_cuda:
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, causal, zero, zero)[:3]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, kernels_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = k.contiguous(), v.contiguous()
    out = lse = None
    for i in range(cp):
        if i < cp - 1 and not kernels_only:
            torch.cat([k.flatten(), v.flatten()])  # the buffer passed on
        kk, vv = (k, v) if i == 0 else (k.chunk(2, dim=2)[0], v.chunk(2, dim=2)[0])
        block, block_lse = _flash(q, kk, vv, causal=i == 0)
        if kernels_only:
            out, lse = block, block_lse
            continue
        block, block_lse = block.float(), block_lse.float().unsqueeze(-1)
        if out is None:
            out, lse = block, block_lse
        else:
            out = out - F.sigmoid(block_lse - lse) * (out - block)
            lse = lse - F.logsigmoid(lse - block_lse)
    assert out is not None and lse is not None
    return (out, lse) if kernels_only else (out.to(q.dtype), lse.squeeze(-1))


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, cp: int, kernels_only: bool) -> Tensors:
    k, v = k.contiguous(), v.contiguous()
    if kernels_only:
        for i in range(cp):
            kk, vv = (k, v) if i == 0 else (k.chunk(2, dim=2)[0], v.chunk(2, dim=2)[0])
            grads = _flash_backward(dout, q, kk, vv, out, lse, causal=i == 0)
        return grads
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    for i in range(cp):
        if i < cp - 1:
            torch.cat([k.flatten(), v.flatten()])
        kk, vv = (k, v) if i == 0 else (k.chunk(2, dim=2)[0], v.chunk(2, dim=2)[0])
        gq, gk, gv = _flash_backward(dout, q, kk, vv, out, lse, causal=i == 0)
        if i == 0:
            dk += gk
            dv += gv
        else:  # the received key/value gradients, this step's added into their first chunk, the whole rebuilt
            dk = torch.cat([dk.chunk(2, dim=2)[0] + gk, dk.chunk(2, dim=2)[1]], dim=2)
            dv = torch.cat([dv.chunk(2, dim=2)[0] + gv, dv.chunk(2, dim=2)[1]], dim=2)
        torch.cat([dk.flatten(), dv.flatten()])  # passed on
        dq += gq
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def predicted(heads: int, head_dim: int, tokens: int, cp: int, kind: str) -> dict[str, Any]:
    """The planner's seconds for the same layer's attention on one device of the planner's ``kind`` (bf16)."""
    cl = cluster_from(kind)
    hidden = heads * head_dim
    spec = ModelSpec(n_layer=1, hidden=hidden, n_head=heads, n_kv_head=heads, ffn_hidden=hidden, vocab=1,
                     block_params=0, block_matrix_params=0, embed_params=0, head_params=0, other_params=0)
    forward = attention_flops(spec, Candidate(cp=cp), tokens, tokens * cp) / (cl.peak_tflops * 1e12 * cl.attention_efficiency)
    ring = [b * tokens * hidden / (cl.hbm_gbps * 1e9) for b in ring_attention_bytes(cp)]  # bf16: 2 bytes, counted per 2
    return {"cluster": kind, "kernels_forward_s": forward, "kernels_backward_s": 3.5 * forward,
            "ring_forward_s": forward + ring[0], "ring_backward_s": 3.5 * forward + ring[1]}


def with_prediction(row: dict[str, Any], heads: int, head_dim: int, tokens: int, kind: str) -> dict[str, Any]:
    """``row`` with the planner's seconds beside its measurement (``--repredict`` calls it again)."""
    row["planner"] = predicted(heads, head_dim, tokens, row["cp"], kind)
    row["ring_over_predicted"] = ((row["ring_forward_s"] + row["ring_backward_s"])
                                  / (row["planner"]["ring_forward_s"] + row["planner"]["ring_backward_s"]))
    return row


def ring_attention(accelerator: str, *, heads: int = 32, head_dim: int = 128, tokens: int = 32768,
                   cps: tuple[int, ...] = (1, 2, 4, 8), repeats: int = 3) -> dict[str, Any]:
    """Per cp: the median seconds of the rank's flash kernels alone and of its whole ring step (forward, backward),
    the kernels' TFLOP/s, and the planner's seconds for both."""
    device = torch.device(accelerator)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, tokens, head_dim, device=device, dtype=dtype, generator=g) for _ in range(4))
    kind = cluster_kind("cpu" if device.type == "cpu" else torch.cuda.get_device_name(device))
    rows = []
    for cp in cps:
        out, lse = _forward(q, k, v, cp, kernels_only=False)
        flops = 4.0 * cp * tokens * tokens * heads * head_dim / 2  # every step half a full local block
        row: dict[str, Any] = {"cp": cp, "sequence": tokens * cp, "forward_tflop": flops / 1e12}
        for name, only in (("kernels", True), ("ring", False)):
            row[f"{name}_forward_s"] = _seconds(partial(_forward, q, k, v, cp, only), device, repeats)
            row[f"{name}_backward_s"] = _seconds(partial(_backward, dout, q, k, v, out, lse, cp, only), device, repeats)
        row["kernels_forward_tflops"] = flops / row["kernels_forward_s"] / 1e12
        row["kernels_backward_tflops"] = 2.5 * flops / row["kernels_backward_s"] / 1e12
        rows.append(with_prediction(row, heads, head_dim, tokens, kind))
    return {"heads": heads, "head_dim": head_dim, "tokens_per_rank": tokens, "dtype": str(dtype), "cluster": kind,
            "rows": rows}
