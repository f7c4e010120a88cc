"""Step time of a layout, predicted: GEMM rooflines, collective volumes over the link model, and the bubble.

Each GEMM costs the larger of its FLOPs at the reachable fraction of peak (by shape and precision) and its bytes at
memory bandwidth, so thin tensor-parallel slices of small models turn memory-bound as they do on a device;
attention and the elementwise ops between GEMMs (eager or compiled, with Float8's casts) are costed in
``kernels.py``. Collectives cost a ring's
volume over the bandwidth of the link their group spans, plus a start-up latency. Tensor- and expert-parallel
collectives sit on the critical path; context-parallel ring passes hide behind attention and FSDP's gathers and
reductions behind compute, up to what compute there is; the pipeline adds its bubble.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_llmpar.planner.candidate import Candidate
from lightning_llmpar.planner.cluster import Cluster, Precision
from lightning_llmpar.planner.kernels import (
    BACKWARD_BYTES,
    WEIGHT_CAST,
    attention_flops,
    elementwise_bytes,
    float8_cast_bytes,
    gemm_seconds,
    layer_gemms,
    ring_attention_bytes,
)
from lightning_llmpar.planner.memory import eager_autocast
from lightning_llmpar.planner.spec import ModelSpec
from lightning_llmpar.planner.split import rank_blocks, rank_params

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


def _bf16_rate(cl: Cluster, p: Precision) -> float:
    return cl.peak_tflops if p.name == "fp8" else cl.tflops(p)  # what is not a float8 linear runs in bf16


def _gemm(m: float, k: float, n: float, cl: Cluster, p: Precision, fp8: str | None = None) -> float:
    return gemm_seconds(m, k, n, cl, p, fp8)


def _ring(volume: float, ranks: int, gbps: float, cl: Cluster, factor: float = 1.0) -> float:
    """A ring collective over ``ranks`` moving ``volume`` bytes per rank (factor 2: all-reduce)."""
    if ranks <= 1:
        return 0.0
    return factor * (ranks - 1) / ranks * volume / (gbps * 1e9) + cl.latency_us * 1e-6


@dataclass(frozen=True)
class _Layer:
    """One layer on one microbatch, forward: GEMMs, attention kernel, elementwise ops (seconds); and what
    backward and each checkpointing mode's recomputation add."""

    gemm: float
    attention: float
    elementwise: float
    overhead: float
    unsaved_gemm: float  # the matmuls torchtitan's op policy recomputes (every second one)
    ring_forward: float = 0.0  # context parallel: the ring's copies and merges outside the attention kernels
    ring_backward: float = 0.0

    @property
    def forward(self) -> float:
        return self.gemm + self.attention + self.ring_forward + self.elementwise + self.overhead

    def recompute(self, mode: str) -> float:
        if mode == "selective_op":
            return self.unsaved_gemm + self.elementwise + self.overhead
        attention = self.attention + self.ring_forward
        return {"none": 0.0, "selective": self.forward - attention, "full": self.forward,
                "every_2": self.forward / 2}[mode]

    def train(self, mode: str, backward_bytes: float) -> float:
        # Backward: two GEMMs per forward GEMM; flash attention's backward is 2.5x its forward FLOPs at a lower
        # rate (3.5x the time); elementwise backward moves ``backward_bytes`` x forward's bytes.
        return (3 * self.gemm + 4.5 * self.attention + self.ring_forward + self.ring_backward
                + (1 + backward_bytes) * self.elementwise + 3 * self.overhead + self.recompute(mode))


def _layer(spec: ModelSpec, c: Candidate, tokens: float, seq: int, cl: Cluster, p: Precision) -> _Layer:
    h = spec.hidden
    fp8 = c.float8
    shapes = layer_gemms(spec, c)
    if spec.n_expert:  # each local expert multiplies its share of the routed tokens
        local = spec.n_expert / c.ep
        per_expert = tokens * spec.top_k / spec.n_expert * c.ep
        mlp = [local * _gemm(per_expert, k, n, cl, p, fp8) for k, n in shapes[4:]]
        mlp.append(_gemm(tokens, h, spec.n_expert, cl, p))
    else:
        mlp = [_gemm(tokens, k, n, cl, p, fp8) for k, n in shapes[4:]]
    times = [_gemm(tokens, k, n, cl, p, fp8) for k, n in shapes[:4]] + mlp
    attention = attention_flops(spec, c, tokens, seq) / (_bf16_rate(cl, p) * 1e12 * cl.attention_efficiency)
    if cl.elementwise_passes:  # norms, RoPE, SiLU, residuals as passes over the layer's input
        moved = cl.elementwise_passes * tokens * h * p.act_bytes
    else:
        moved = elementwise_bytes(spec, c, eager_autocast(c, p)) * tokens * p.act_bytes / 2
        moved += float8_cast_bytes(spec, c, tokens)[0]
    # The ring's bytes are counted for bf16 activations; full precision moves about twice as many.
    ring = [b * tokens * h / c.tp * p.act_bytes / 2 / (cl.hbm_gbps * 1e9) for b in ring_attention_bytes(c.cp)]
    return _Layer(gemm=sum(times), attention=attention, elementwise=moved / (cl.hbm_gbps * 1e9),
                  overhead=cl.layer_overhead_us * 1e-6, unsaved_gemm=times[1] + times[3] + times[5],
                  ring_forward=ring[0], ring_backward=ring[1])


def _attention_recomputed(mode: str) -> float:
    """Forward passes of attention a checkpointing mode runs again (the op policy and "selective" keep its output)."""
    return {"full": 1.0, "every_2": 0.5}.get(mode, 0.0)


def _ring_exposed(spec: ModelSpec, c: Candidate, tokens: float, lay: _Layer, cl: Cluster, p: Precision) -> float:
    """Seconds of one layer's context-parallel communication that attention does not hide, on one microbatch, as
    torch's ring runs it (all-gather rotation, its default and torchtitan's): each forward all-gathers every
    rank's keys and values once and waits for them after the first of its ``cp`` equal steps; backward does the
    same, and passes the fp32 key/value gradients on after each step, waiting for each during the next step and
    for the last one at the end. Keys and values are repeated to the query heads (see ``ring_attention_bytes``)."""
    if c.cp == 1:
        return 0.0
    kv = tokens * 2 * spec.hidden / c.tp  # elements of one rank's keys and values
    bandwidth = cl.link_gbps(c.tp * c.cp) * 1e9
    latency = cl.latency_us * 1e-6
    gather = (c.cp - 1) * kv * p.act_bytes / bandwidth + latency
    send = kv * 4 / bandwidth + latency  # fp32 gradients to the next rank
    step_forward = lay.attention / c.cp
    step_backward = 3.5 * step_forward
    forward = max(0.0, gather - step_forward)
    backward = max(0.0, gather - step_backward) + (c.cp - 1) * max(0.0, send - step_backward) + send
    return forward * (1 + _attention_recomputed(c.checkpointing)) + backward


def _tp_passes(mode: str) -> float:
    """Forward passes whose tensor-parallel collectives run: forward, backward, and the recomputation (torchtitan's
    op policy saves reduce-scatter outputs, so only the all-gathers run again)."""
    return 2 + {"none": 0.0, "selective": 1.0, "full": 1.0, "selective_op": 0.5, "every_2": 0.5}[mode]


def predict_step_time(spec: ModelSpec, c: Candidate, seq: int, cl: Cluster, p: Precision) -> TimeEstimate:
    """The step of the slowest pipeline rank (each rank's blocks as the run splits them, ``planner.split``; the
    last one also runs the head and the loss): the others wait for it in steady state."""
    # Ranks differ only by their blocks and by holding the first or last stage.
    kinds = {(sum(rank_blocks(spec, c, r)), r == 0, r == c.pp - 1): r for r in range(c.pp)}
    return max((_rank_step(spec, c, seq, cl, p, rank) for rank in kinds.values()), key=lambda t: t.step)


def _rank_step(spec: ModelSpec, c: Candidate, seq: int, cl: Cluster, p: Precision, rank: int) -> TimeEstimate:
    layers, last = sum(rank_blocks(spec, c, rank)), rank == c.pp - 1
    tokens = c.micro_batch * seq / c.cp
    lay = _layer(spec, c, tokens, seq, cl, p)
    backward_bytes = 2.0 if cl.elementwise_passes else BACKWARD_BYTES
    layer = lay.train(c.checkpointing, backward_bytes)
    if c.float8 and not cl.elementwise_passes:
        layer += float8_cast_bytes(spec, c, tokens)[1] / (cl.hbm_gbps * 1e9)
    if eager_autocast(c, p) and not cl.elementwise_passes:  # each weight's cast and its gradient's, per microbatch
        layer += 2 * WEIGHT_CAST * sum(k * n for k, n in layer_gemms(spec, c)) / (cl.hbm_gbps * 1e9)
    head = 0.0
    if last:  # the head's three GEMMs and the loss's passes over the fp32 logits
        head = (3 * _gemm(tokens, spec.hidden, spec.vocab / c.tp, cl, p)
                + 8 * tokens * spec.vocab * 4 / (cl.hbm_gbps * 1e9))
    compute_mb = layers * layer + head

    act = tokens * spec.hidden * p.act_bytes
    tp_span, cp_span = c.tp, c.tp * c.cp
    tp_bw = cl.link_gbps(tp_span)
    # Per pass: an all-gather and a reduce-scatter around attention and around the MLP (sequence parallel), or an
    # all-reduce after each; float8 linears gather their inputs in fp8.
    gather = act / p.act_bytes if c.float8 else act
    if c.sequence_parallel:
        per_pass = 2 * (_ring(gather, c.tp, tp_bw, cl) + _ring(act, c.tp, tp_bw, cl))
    else:
        per_pass = 2 * _ring(act, c.tp, tp_bw, cl, factor=2)
    passes = _tp_passes(c.checkpointing)
    hidden = 0.0
    if c.async_tp:  # forward-shaped patterns (forward and recomputed forward) run in tp chunks; the first is exposed
        hidden = cl.async_tp_overlap * (passes - 1) / passes * (c.tp - 1) / c.tp
    tp_mb = layers * passes * per_pass * (1 - hidden)
    cp_mb = layers * _ring_exposed(spec, c, tokens, lay, cl, p)
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
    # The rank's own parameters: the embedding on the first stage, the head (a copy when tied) on the last.
    params, _ = rank_params(spec, c, rank)
    dp = _data_parallel(c, cl, p, params)
    units = layers + 1 if c.pp == 1 else c.virtual
    dp_exposed = max(dp / units, dp - cl.comm_overlap * ticks * compute_mb) if dp else 0.0
    local = params / c.shard
    optimizer = 28.0 * local / (cl.hbm_gbps * 1e9)  # read/write master and moments, read the gradient
    step = pipeline + bubble + dp_exposed + optimizer
    tokens_step = c.global_batch * seq
    mfu = model_flops_per_token(spec, seq) * tokens_step / (step * c.world_size * cl.tflops(p) * 1e12)
    return TimeEstimate(
        compute=ticks * compute_mb, tensor_parallel=ticks * tp_mb, context_parallel=ticks * cp_mb,
        expert_parallel=ticks * ep_mb, pipeline_p2p=ticks * p2p_mb, bubble=bubble, data_parallel=dp_exposed,
        optimizer=optimizer, step=step, tokens_per_s=tokens_step / step, mfu=mfu,
    )


def _data_parallel(c: Candidate, cl: Cluster, p: Precision, local: float) -> float:
    """Seconds of gradient reduction and parameter gathering per optimizer step (before overlap) of a rank holding
    ``local`` parameters (after tensor and expert splits, ``rank_params``)."""
    if not c.fsdp:
        return 0.0
    shard_ranks = c.shard
    replicas = c.dp_replicate if c.zero else c.dp
    inner = cl.link_gbps(shard_ranks * c.tp)
    outer = cl.link_gbps(c.dp * c.cp * c.tp)
    param_bytes = 1 if c.float8_all_gather else p.param_bytes  # float8 weights gathered in fp8
    t = 0.0
    if c.zero == 0:
        t += _ring(local * p.reduce_bytes, replicas * c.cp, outer, cl, factor=2)
    else:
        gathers = 2 * c.microbatches if c.zero == 3 else 1
        t += gathers * _ring(local * param_bytes, shard_ranks, inner, cl)
        t += _ring(local * p.reduce_bytes, shard_ranks, inner, cl)
        if replicas > 1:
            t += _ring(local / shard_ranks * p.reduce_bytes, replicas, outer, cl, factor=2)
    return t
