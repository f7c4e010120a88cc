"""Step time of a layout, predicted: GEMM rooflines, collective volumes over the link model, and the bubble.

Each GEMM costs the larger of its FLOPs at the reachable fraction of peak and its bytes at memory bandwidth, so
thin tensor-parallel slices of small models turn memory-bound as they do on a device. Collectives cost a ring's
volume over the bandwidth of the link their group spans, plus a start-up latency. Tensor- and expert-parallel
collectives sit on the critical path; context-parallel ring passes hide behind attention and FSDP's gathers and
reductions behind compute, up to what compute there is; the pipeline adds its bubble.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_llmpar.planner.candidate import Candidate
from lightning_llmpar.planner.cluster import Cluster, Precision
from lightning_llmpar.planner.spec import ModelSpec

__all__ = ["TimeEstimate", "model_flops_per_token", "predict_step_time"]


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds per optimizer step by cause; ``step`` is their total on the critical path."""

    compute: float
    tensor_parallel: float
    context_parallel: float
    expert_parallel: float
    pipeline_p2p: float
    bubble: float
    data_parallel: float  # the part compute does not hide
    optimizer: float
    step: float
    tokens_per_s: float
    mfu: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def model_flops_per_token(spec: ModelSpec, seq: int) -> float:
    """Training FLOPs per token by the usual count (as ``ThroughputAndMemory`` logs MFU): 6 x the matmul
    parameters a token meets, plus 12 x layers x width x sequence for attention."""
    head = spec.head_params or spec.embed_params
    return 6.0 * (spec.active_matrix_params_per_token + head) + 12.0 * spec.n_layer * spec.hidden * seq


def _gemm(m: float, k: float, n: float, cl: Cluster, p: Precision) -> float:
    flops = 2.0 * m * k * n / (cl.tflops(p) * 1e12 * cl.matmul_efficiency)
    traffic = (m * k + k * n + m * n) * p.act_bytes / (cl.hbm_gbps * 1e9)
    return max(flops, traffic)


def _ring(volume: float, ranks: int, gbps: float, cl: Cluster, factor: float = 1.0) -> float:
    """A ring collective over ``ranks`` moving ``volume`` bytes per rank (factor 2: all-reduce)."""
    if ranks <= 1:
        return 0.0
    return factor * (ranks - 1) / ranks * volume / (gbps * 1e9) + cl.latency_us * 1e-6


def _layer_forward(
    spec: ModelSpec, c: Candidate, tokens: float, seq: int, cl: Cluster, p: Precision
) -> tuple[float, float]:
    """One layer's forward on one microbatch: (all of it, its attention kernel alone)."""
    h, tp = spec.hidden, c.tp
    head_dim = h / spec.n_head
    q, kv = h / tp, max(spec.n_kv_head / tp, 1) * head_dim  # fewer key/value heads than ranks: one on each
    t = _gemm(tokens, h, q, cl, p) + 2 * _gemm(tokens, h, kv, cl, p) + _gemm(tokens, q, h, cl, p)
    f = spec.ffn_hidden / tp
    if spec.n_expert:  # each local expert multiplies its share of the routed tokens
        local = spec.n_expert / c.ep
        per_expert = tokens * spec.top_k / spec.n_expert * c.ep
        t += local * (2 * _gemm(per_expert, h, f, cl, p) + _gemm(per_expert, f, h, cl, p))
        t += _gemm(tokens, h, spec.n_expert, cl, p)
    else:
        t += 2 * _gemm(tokens, h, f, cl, p) + _gemm(tokens, f, h, cl, p)
    # Causal attention: half of QK^T and PV over the whole sequence (context parallel ranks see all keys).
    attention = 2.0 * tokens * seq * h / tp / (cl.tflops(p) * 1e12 * cl.attention_efficiency)
    elementwise = 30.0 * tokens * h * p.act_bytes / (cl.hbm_gbps * 1e9)  # norms, RoPE, SiLU, residuals
    return t + attention + elementwise + cl.layer_overhead_us * 1e-6, attention


def predict_step_time(spec: ModelSpec, c: Candidate, seq: int, cl: Cluster, p: Precision) -> TimeEstimate:
    tokens = c.micro_batch * seq / c.cp
    layers = -(-spec.n_layer // c.pp)
    forward, attention = _layer_forward(spec, c, tokens, seq, cl, p)
    recompute = {"none": 0.0, "selective": forward - attention, "full": forward}[c.checkpointing]
    layer = 3 * forward + 1.5 * attention + recompute  # backward: two GEMMs per forward GEMM, flash's 2.5x
    head = 3 * _gemm(tokens, spec.hidden, spec.vocab / c.tp, cl, p) + 8 * tokens * spec.vocab * 4 / (cl.hbm_gbps * 1e9)
    compute_mb = layers * layer + head  # the last stage, which also runs the head and the loss

    act = tokens * spec.hidden * p.act_bytes
    tp_span, cp_span = c.tp, c.tp * c.cp
    tp_bw = cl.link_gbps(tp_span)
    passes = 4 + (2 if c.checkpointing == "full" else 0)  # forward, backward, and the recomputed forward
    if c.sequence_parallel:  # an all-gather and a reduce-scatter around attention and around the MLP
        tp_mb = layers * passes * _ring(act, c.tp, tp_bw, cl)
    else:
        tp_mb = layers * passes / 2 * _ring(act, c.tp, tp_bw, cl, factor=2)
    kv_bytes = tokens * 2 * max(spec.n_kv_head / c.tp, 1) * spec.hidden / spec.n_head * p.act_bytes
    cp_ring = 3 * (c.cp - 1) * kv_bytes / (cl.link_gbps(cp_span) * 1e9) if c.cp > 1 else 0.0
    cp_mb = layers * max(0.0, cp_ring - 3.5 * attention)
    ep_mb = 0.0
    if spec.n_expert and c.ep > 1:
        routed = tokens * spec.top_k * spec.hidden * p.act_bytes
        ep_mb = layers * 4 * _ring(routed, c.ep, cl.link_gbps(c.ep * cp_span), cl)
    p2p_mb = 0.0
    if c.pp > 1:
        pp_bw = cl.link_gbps(c.world_size)
        p2p_mb = 2 * c.virtual * (act / (pp_bw * 1e9) + cl.latency_us * 1e-6)
    per_mb = compute_mb + tp_mb + cp_mb + ep_mb + p2p_mb
    ticks = c.microbatches
    bubble_fraction = (c.pp - 1) / (c.virtual * ticks) if c.pp > 1 and c.schedule != "GPipe" else 0.0
    if c.schedule == "GPipe":
        bubble_fraction = (c.pp - 1) / ticks
    pipeline = ticks * per_mb
    bubble = pipeline * bubble_fraction

    # FSDP prefetches the next unit's gather and reduces the last one's gradients while computing, so compute
    # hides up to ``comm_overlap`` of its time, all but about one unit's share (one stage's under a pipeline).
    dp = _data_parallel(spec, c, cl, p, layers)
    units = layers + 1 if c.pp == 1 else c.virtual
    dp_exposed = max(dp / units, dp - cl.comm_overlap * ticks * compute_mb) if dp else 0.0
    local = (layers * spec.block_params + spec.embed_params + spec.head_params) / c.tp / c.shard
    optimizer = 28.0 * local / (cl.hbm_gbps * 1e9)  # read/write master and moments, read the gradient
    step = pipeline + bubble + dp_exposed + optimizer
    tokens_step = c.global_batch * seq
    mfu = model_flops_per_token(spec, seq) * tokens_step / (step * c.world_size * cl.tflops(p) * 1e12)
    return TimeEstimate(
        compute=ticks * compute_mb, tensor_parallel=ticks * tp_mb, context_parallel=ticks * cp_mb,
        expert_parallel=ticks * ep_mb, pipeline_p2p=ticks * p2p_mb, bubble=bubble, data_parallel=dp_exposed,
        optimizer=optimizer, step=step, tokens_per_s=tokens_step / step, mfu=mfu,
    )


def _data_parallel(spec: ModelSpec, c: Candidate, cl: Cluster, p: Precision, layers: int) -> float:
    """Seconds of gradient reduction and parameter gathering per optimizer step (before overlap)."""
    if not c.fsdp:
        return 0.0
    local = (layers * spec.block_params + spec.embed_params + spec.head_params) / c.tp
    shard_ranks = c.shard
    replicas = c.dp_replicate if c.zero else c.dp
    inner = cl.link_gbps(shard_ranks * c.tp)
    outer = cl.link_gbps(c.dp * c.cp * c.tp)
    t = 0.0
    if c.zero == 0:
        t += _ring(local * p.reduce_bytes, replicas * c.cp, outer, cl, factor=2)
    else:
        gathers = 2 * c.microbatches if c.zero == 3 else 1
        t += gathers * _ring(local * p.param_bytes, shard_ranks, inner, cl)
        t += _ring(local * p.reduce_bytes, shard_ranks, inner, cl)
        if replicas > 1:
            t += _ring(local / shard_ranks * p.reduce_bytes, replicas, outer, cl, factor=2)
    return t
