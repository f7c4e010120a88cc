"""What one layer's kernels cost on a device: GEMMs by shape and precision, causal attention, and the elementwise
ops between them, eager or fused by torch.compile, with Float8's casts.

Every figure here is per token (or per GEMM) and per forward pass; ``speed.py`` multiplies by passes and
microbatches. The byte counts are written op by op from a Llama block as torchtitan and Hugging Face write it
(RMSNorm in fp32, complex RoPE, SwiGLU, grouped key/value heads repeated before SDPA): eager PyTorch reads and
writes every intermediate; inductor fuses each chain of elementwise ops into one kernel that reads its inputs
once and writes its outputs once.
"""

from __future__ import annotations

from lightning_llmpar.planner.candidate import Candidate
from lightning_llmpar.planner.cluster import Cluster, Precision
from lightning_llmpar.planner.spec import ModelSpec

__all__ = [
    "attention_flops", "elementwise_bytes", "float8_cast_bytes", "gemm_seconds", "layer_gemms", "ring_attention_bytes",
]

# Bytes per element, forward. RMSNorm eager: x.float() (r2 w4), pow (r4 w4), mean (r4), x * rsqrt (r4 w4),
# type_as (r4 w2), * weight (r2 w2); compiled: one kernel reading the residual stream and the branch (r2 r2) and
# writing the sum and the normed value (w2 w2), the residual add fused in.
NORM_EAGER, NORM_COMPILED = 36.0, 8.0
RESIDUAL_EAGER = 6.0  # r2 r2 w2, a kernel of its own when eager
ROPE_EAGER, ROPE_COMPILED = 20.0, 4.0  # float (r2 w4), complex multiply (r4 w4), type_as (r4 w2); fused: r2 w2
REPEAT_KV = 4.0  # grouped key/value heads expanded to every query head before SDPA: r2 w2 per expanded element
TRANSPOSE = 4.0  # attention output back to (tokens, heads x dim), contiguous: r2 w2
SWIGLU_EAGER, SWIGLU_COMPILED = 10.0, 6.0  # silu (r2 w2) then multiply (r2 r2 w2); fused: r2 r2 w2
# Eager bf16 autocast over fp32 parameters (``memory.eager_autocast``): the residual stream is fp32, so RMSNorm's
# float() and type_as() are no-ops (pow r4 w4, mean r4, x * rsqrt r4 w4, * weight r4 w4), a residual add reads fp32
# and bf16 and writes fp32 (r4 r2 w4), and each of the five projections casts its fp32 input to bf16 (r4 w2).
NORM_AUTOCAST, RESIDUAL_AUTOCAST, INPUT_CAST = 28.0, 10.0, 6.0
# Each weight a matmul uses is cast to bf16 once per forward (r4 w2) and its bf16 gradient to fp32 (r2 w4).
WEIGHT_CAST = 6.0
BACKWARD_BYTES = 2.0  # backward reads what forward wrote plus the incoming gradient, and writes gradients
# Float8 dynamic scaling of one GEMM operand: amax (r2) then scale-and-cast (r2 w1); compiled, the amax fuses
# into the producer of the operand. Backward also needs column-major copies of the input and the gradient.
CAST_EAGER, CAST_COMPILED = 5.0, 3.0
TRANSPOSED_CAST_EAGER, TRANSPOSED_CAST_COMPILED = 3.0, 2.0
ROWWISE_GEMM = 0.85  # rowwise-scaled fp8 GEMMs (CUTLASS, late 2024) against tensorwise ones (cuBLAS)


def _shape(d: float, knee: float) -> float:
    """A dimension's share of the tile-level efficiency, 1 at 8192 (the size the peak fraction is quoted at)."""
    return (d / (d + knee)) / (8192 / (8192 + knee)) if knee else 1.0


def gemm_seconds(m: float, k: float, n: float, cl: Cluster, p: Precision, fp8: str | None = None) -> float:
    """One (m x k) @ (k x n) GEMM: its FLOPs at the reachable rate for its shape and precision, or its bytes at
    memory bandwidth, whichever is longer."""
    if fp8:
        peak = cl.fp8_tflops or 2 * cl.peak_tflops
        rate = peak * cl.fp8_matmul_efficiency * (ROWWISE_GEMM if fp8 == "rowwise" else 1.0)
    else:  # a linear float8 leaves alone (the head) runs at the bf16 rate
        rate = (cl.peak_tflops if p.name == "fp8" else cl.tflops(p)) * cl.matmul_efficiency
    rate *= min(1.0, _shape(m, cl.gemm_knee) * _shape(k, cl.gemm_knee) * _shape(n, cl.gemm_knee))
    flops = 2.0 * m * k * n / (rate * 1e12)
    traffic = (m * k + k * n + m * n) * (1 if fp8 else p.act_bytes) / (cl.hbm_gbps * 1e9)
    return max(flops, traffic)


def layer_gemms(spec: ModelSpec, c: Candidate) -> list[tuple[float, float]]:
    """(k, n) of one dense layer's projections on one tensor-parallel rank: q, k, v, o, gate, up, down."""
    h, tp = spec.hidden, c.tp
    q, kv = h / tp, max(spec.n_kv_head / tp, 1) * h / spec.n_head  # fewer key/value heads than ranks: one each
    f = spec.ffn_hidden / tp
    return [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]


def attention_flops(spec: ModelSpec, c: Candidate, tokens: float, seq: int) -> float:
    """Forward FLOPs of causal attention for ``tokens`` queries of sequences of ``seq``: QK^T and PV over half
    the keys on average (context-parallel ranks see every key over the ring, load-balanced)."""
    return 2.0 * tokens * seq * spec.hidden / c.tp


def elementwise_bytes(spec: ModelSpec, c: Candidate, autocast: bool = False) -> float:
    """Bytes one token moves through one layer's elementwise ops in forward (backward: ``BACKWARD_BYTES`` x);
    ``autocast``: eager autocast over fp32 parameters, whose norms and residual adds run on an fp32 stream."""
    h, tp = spec.hidden, c.tp
    stream = h / tp if (c.sequence_parallel and tp > 1) else h  # norms and residuals on a sequence shard
    q, kv = h / tp, max(spec.n_kv_head / tp, 1) * h / spec.n_head
    f = spec.ffn_hidden * (spec.top_k if spec.n_expert else 1) / tp
    repeat = REPEAT_KV * 2 * q if kv < q else 0.0
    if c.compile:
        return 2 * NORM_COMPILED * stream + ROPE_COMPILED * (q + kv) + repeat + TRANSPOSE * q + SWIGLU_COMPILED * f
    norms = (2 * (NORM_AUTOCAST + RESIDUAL_AUTOCAST) * stream + 5 * INPUT_CAST * h if autocast
             else 2 * (NORM_EAGER + RESIDUAL_EAGER) * stream)
    return norms + ROPE_EAGER * (q + kv) + repeat + TRANSPOSE * q + SWIGLU_EAGER * f


def float8_cast_bytes(spec: ModelSpec, c: Candidate, tokens: float) -> tuple[float, float]:
    """Bytes of one layer's float8 casts on one microbatch: (forward, backward). Weights are cast once per
    gather when FSDP gathers them in fp8 (scales precomputed after the step), else at each use."""
    if not c.float8:
        return 0.0, 0.0
    cast = CAST_COMPILED if c.compile else CAST_EAGER
    transposed = TRANSPOSED_CAST_COMPILED if c.compile else TRANSPOSED_CAST_EAGER
    shapes = layer_gemms(spec, c)
    ins = sum(k for k, _ in shapes)
    outs = sum(n for _, n in shapes)
    weights = sum(k * n for k, n in shapes)
    forward = tokens * ins * cast
    backward = tokens * (outs * cast + (ins + outs) * transposed)
    if not c.float8_all_gather:
        forward += weights * cast
        backward += weights * transposed
    return forward, backward


def ring_attention_bytes(cp: int) -> tuple[float, float]:
    """Bytes per element of a rank's attention output (its tokens x the attention width on its rank) that torch's
    ring attention (``context_parallel``, all-gather rotation, round-robin load balance, fp32 merging) moves
    outside its flash kernels in one layer: (forward, backward). It runs eager, between compiled graphs. Counted
    from its code for the rank whose ring steps all use the full query (the last; the others merge half the rows
    and copy the whole tensor, about as much):

    - forward: contiguous key and value (r2 w2 each); per step, the key and value concatenated to send (r2 w2
      each, every step but the last); per step after the first, the block output upcast to fp32 (r2 w4) and the
      log-sum-exp merge (out - block: r4 r4 w4; times the weight: r4 w4; out - that: r4 r4 w4); the first
      step's upcast and the result's downcast (r2 w4, r4 w2);
    - backward: contiguous key and value again, fp32 zeroed accumulators (w4 x 3), per step the query gradient
      added in fp32 (r4 r2 w4), the key and value gradients added into their chunk and the whole rebuilt (r4 r2 w4
      on half, r4 w4) and concatenated to pass on (r4 w4 each), the key and value concatenated to send; at the
      end the three gradients cast down (r4 w2 each).

    Grouped key/value heads are repeated to every query head before SDPA (torchtitan's and Hugging Face's Llama,
    and ``context_parallel_attention``), so keys and values are as wide as the queries. 0 without cp."""
    if cp == 1:
        return 0.0, 0.0
    forward = 8 + 8 * (cp - 1) + 38 * (cp - 1) + 6 + 6
    backward = 8 + 12 + 60 * (cp - 1) + 54 + 18
    return float(forward), float(backward)
