"""Per-rank peak memory of a training step, predicted term by term.

The peak is the larger of two moments. In forward/backward a rank holds its parameter shards, the gathered
copies FSDP2 computes with (the whole rank's parameters at ZeRO 0-2, which keep them gathered through backward;
two units at a time at ZeRO-3) or, in bf16 without FSDP, autocast's bf16 weight copies, AdamW's moments, the
gradients when they outlive a microbatch (pipeline or accumulation), what each in-flight microbatch keeps for
backward, one layer's full activations while a backward or a recomputation runs, the loss's fp32 logits, and the
pipeline's receive buffers. At the optimizer step it holds parameters, gradients, moments and the step's
temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lightning_llmpar.planner.candidate import Candidate, in_flight, schedule_actions
from lightning_llmpar.planner.cluster import Precision
from lightning_llmpar.planner.spec import ModelSpec
from lightning_llmpar.planner.split import FP32, rank_blocks, rank_matmul_params, rank_params

__all__ = ["MemoryEstimate", "gib_text", "activation_elements", "autocast_over_fp32", "eager_autocast", "predict_memory",
           "predict_rank_memory", "ring_attention_backward_bytes"]

ADAM_STATE_BYTES = 8  # two fp32 moments per parameter
# The share of a layer's matmuls whose inputs backward recomputes, by checkpointing mode.
RECOMPUTED_SHARE = {"none": 0.0, "full": 1.0, "selective": 1.0, "every_2": 0.5, "selective_op": 0.5}


def gib_text(size: float) -> str:
    """Bytes in GiB with two decimals, or two significant digits under 0.1 GiB (a tiny model's peak read 0.00)."""
    gib = size / 2**30
    return f"{gib:.2f}" if gib >= 0.1 or gib == 0 else f"{gib:.2g}"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the fullest pipeline rank, term by term (``peak`` is what must fit)."""

    parameters: float
    gathered: float
    gradients: float
    optimizer: float
    activations: float
    logits: float  # the loss's fp32 logits, and the outputs a pipeline keeps to the step's end
    buffers: float
    peak: float
    rank: int  # the pipeline rank the figures are for

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in self.__dict__.items()}


def activation_elements(spec: ModelSpec, c: Candidate, mode: str, autocast: bool = False) -> float:
    """Elements per token one layer keeps for backward under checkpointing ``mode`` (see
    ``activation_checkpointing.memory.block_activation_formula`` for the none-mode terms). Tensor parallelism
    splits the attention and MLP terms; with sequence parallelism the norms work on a 1/tp slice of the
    sequence, but the projections keep the gathered (full) input.

    ``autocast``: eager bf16 autocast over fp32 parameters (``eager_autocast``), counted in 2-byte elements. The
    embedding's output is fp32, so the residual stream stays fp32 and each block's input counts twice. Each norm
    keeps its fp32 input and normalized tensor, and its fp32 output is not kept: each of the five projections
    keeps its own bf16 cast of it instead (measured on one H100, ``benchmarks/gpu/phases.py``)."""
    h, a, f, tp = spec.hidden, spec.n_head, spec.ffn_hidden, c.tp
    sp = c.sequence_parallel and tp > 1
    norm_width = h / tp if sp else h
    block_input = norm_width * (2 if autocast else 1)
    if mode == "full":
        return block_input
    if mode == "selective":  # the block's input and the attention kernel's output and log-sum-exp
        return block_input + (h + a) / tp
    if mode == "every_2":
        return (activation_elements(spec, c, "none", autocast) + block_input) / 2
    if mode == "selective_op":
        # torchtitan's op policy keeps every odd matmul's output (q, v, gate, down) and attention's. Compiled,
        # the partitioner keeps only what backward reads: not the down projection's output (a residual's input).
        kv = max(spec.n_kv_head / tp, 1) * h / a
        down = 0.0 if c.compile else (h / tp if sp else h)
        return block_input + h / tp + kv + (h + 2 * a) / tp + f / tp + down
    # Two norms, each keeping its input, normalized tensor and rsqrt, and the projections' input (one shared
    # bf16 tensor; five casts of it under eager autocast).
    per_norm = (2 * h + 1) / tp if sp else 2 * h + 1
    norms = 2 * per_norm + (5 * h if autocast else 2 * h)
    if autocast:
        norms += 2 * per_norm  # the fp32 input and normalized tensor count twice
    attention = (5 * h + a) / tp
    # Experts, their dispatched copies and the router's logits; or the one MLP.
    mlp = spec.top_k * (4 * f / tp + 2 * h) + spec.n_expert if spec.n_expert else 4 * f / tp
    return norms + attention + mlp


def autocast_over_fp32(c: Candidate, p: Precision) -> bool:
    """Whether ``c`` runs bf16 autocast over fp32 parameters: Lightning's bf16-mixed where no FSDP casts the
    parameters to bf16 (one device, tensor or pipeline parallelism alone)."""
    return p.name == "bf16-mixed" and not c.fsdp


def eager_autocast(c: Candidate, p: Precision) -> bool:
    """``autocast_over_fp32``, not compiled. A compiled graph keeps one cast and recomputes the norms: the none-mode
    count holds for it (``benchmarks/results/gpu*.json``)."""
    return autocast_over_fp32(c, p) and not c.compile


def ring_attention_backward_bytes(spec: ModelSpec, c: Candidate, tokens: float) -> float:
    """What torch's ring attention (``context_parallel``) holds at once in one layer's backward beyond the flash
    kernel's inputs, counted from its implementation (all-gather rotation, fp32 accumulation, round-robin load
    balance); zero without context parallelism. Per token, in units of the attention width on this rank (grouped
    key/value heads are repeated to the query heads before SDPA, as Llama code does):

    - 4 x cp: every context-parallel rank's key and value shard, gathered at once (bf16);
    - 4: contiguous copies of the local key and value (bf16);
    - 24: the fp32 key/value gradient received from the previous rank, the new one a chunk update builds from it,
      and the copy concatenated to send on;
    - 8: the fp32 query gradient and the new one a chunk update builds;
    - 6: the kernel's query, key and value gradients of the step (bf16).
    """
    if c.cp == 1:
        return 0.0
    width = spec.hidden / c.tp
    return tokens * width * (4 * c.cp + 4 + 24 + 8 + 6)


# A moment of a rank's schedule, as counts: blocks whose activations forwards keep, blocks of the local stages whose
# backward has begun this step, whether a last-stage microbatch is between its forward and backward (0/1), outputs
# kept.
State = tuple[int, int, int, int]


def _frontier(states: set[State]) -> tuple[State, ...]:
    """The states no other one equals or exceeds in every count (every term of memory grows with each count)."""
    best: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for kept, started, loss, outputs in states:
        best.setdefault((started, loss), []).append((kept, outputs))
    candidates = []
    for (started, loss), pairs in best.items():
        most_outputs = -1
        for kept, outputs in sorted(pairs, reverse=True):  # most kept first: keep only those with more outputs
            if outputs > most_outputs:
                candidates.append((kept, started, loss, outputs))
                most_outputs = outputs
    return tuple(s for s in candidates
                 if not any(o != s and all(x >= y for x, y in zip(o, s, strict=True)) for o in candidates))


def schedule_states(actions: list[tuple[bool, int]], loss_stage: int, blocks: tuple[int, ...] | None = None) -> tuple[
        tuple[State, ...], tuple[State, ...]]:
    """Walk a rank's schedule (``schedule_actions``): the states at the end of each forward, and at both ends of
    each backward (which frees its activations as it makes its gradients, so its peak is at one end or the
    other). ``loss_stage``: the local stage that is the model's last, or -1; ``blocks``: each local stage's
    blocks (default: one each), so a forward through a larger stage keeps more."""
    kept = loss = outputs = started = 0
    seen: set[int] = set()
    at_forward: set[State] = set()
    in_backward: set[State] = set()
    for forward, stage in actions:
        last = int(stage == loss_stage)
        size = blocks[stage] if blocks else 1
        if forward:
            kept, loss, outputs = kept + size, loss + last, outputs + last
            at_forward.add((kept, started, min(loss, 1), outputs))
            continue
        in_backward.add((kept, started, min(loss, 1), outputs))
        if stage not in seen:
            seen.add(stage)
            started += size
        kept, loss = kept - size, loss - last
        in_backward.add((kept, started, min(loss, 1), outputs))
    return _frontier(at_forward), _frontier(in_backward)


@lru_cache(maxsize=4096)
def _states(pp: int, microbatches: int, virtual: int, schedule: str, rank: int, loss_stage: int,
            blocks: tuple[int, ...]) -> tuple[tuple[State, ...], tuple[State, ...]]:
    c = Candidate(pp=pp, microbatches=microbatches, virtual=virtual, schedule=schedule)
    return schedule_states(schedule_actions(c, rank), loss_stage, blocks)


def _walk_schedule(
    states: tuple[tuple[State, ...], tuple[State, ...]], per_block: float, block_grads: float,
    earlier_grads: tuple[float, float], loss: tuple[float, float], outputs: float = 0.0, beside: bool = False,
) -> tuple[float, float]:
    """The most a rank holds beyond its fixed state at the end of a forward and around a backward: the activations
    its forwards keep (``per_block`` for each block they ran) until their backward; the gradients, the larger of the
    earlier step's (``earlier_grads``: at forward, in backward) and the unsharded ones accumulated this step
    (``block_grads`` per block of a local stage from the stage's first backward on); the loss's logits (``loss``:
    at forward, in backward) while a last-stage microbatch is between its forward and backward; and ``outputs``
    per last-stage forward kept to the step's end. ``beside``: the earlier gradients are kept beside this step's
    (a pipeline under Lightning), not replaced by them."""
    def most(moments: tuple[State, ...], earlier: float, logits: float) -> float:
        def held(started: int) -> float:
            return earlier + started * block_grads if beside else max(earlier, started * block_grads)

        return max((kept * per_block + held(started) + loss_open * logits + kept_out * outputs
                    for kept, started, loss_open, kept_out in moments), default=0.0)

    return most(states[0], earlier_grads[0], loss[0]), most(states[1], earlier_grads[1], loss[1])


def predict_memory(
    spec: ModelSpec, c: Candidate, seq: int, precision: Precision, cuda: bool = False
) -> MemoryEstimate:
    """The peak bytes of the fullest pipeline rank for ``c`` training ``spec`` on sequences of ``seq`` tokens;
    ``cuda``: the caching allocator's reserved bytes (see ``_reserved``), else the bytes in use."""
    return max(predict_rank_memory(spec, c, seq, precision, cuda), key=lambda m: m.peak)


def predict_rank_memory(
    spec: ModelSpec, c: Candidate, seq: int, precision: Precision, cuda: bool = False
) -> list[MemoryEstimate]:
    """``predict_memory`` for every pipeline rank, in order."""
    return [_rank_memory(spec, c, seq, precision, r, cuda) for r in range(c.pp)]


def _rank_memory(spec: ModelSpec, c: Candidate, seq: int, p: Precision, rank: int, cuda: bool) -> MemoryEstimate:
    local, unit = rank_params(spec, c, rank)
    ddp = c.replicates(p.name)
    fsdp = c.fsdp and not ddp
    sharded = local / c.shard if fsdp else local
    master = sharded * FP32
    gathered = 0.0
    if fsdp:  # FSDP2 computes with a gathered copy, also on a size-1 shard (float8 weights gathered in fp8)
        gathered = (2 * unit if c.zero == 3 else local) * (1 if c.float8_all_gather else p.param_bytes)
    # Autocast over fp32 weights caches a bf16 copy of every weight a matmul uses.
    weight_copies = rank_matmul_params(spec, c, rank) * p.param_bytes if autocast_over_fp32(c, p) else 0.0
    gathered += weight_copies
    grads = sharded * FP32
    reduce_buffer = unit * FP32 if fsdp else 0.0  # one unit's unsharded gradient before its reduction
    optimizer = sharded * ADAM_STATE_BYTES
    # A step starts without gradients: this strategy releases the previous step's where Lightning's zero_grad would
    # discard them unread (training.zero_grad), and torchtitan zeroes them first. They are held through the step
    # under accumulation over batches (``microbatches`` without a pipeline), where a hook reads them
    # (``holds_previous_grads``), and as DDP's buckets, which the gradients are views of. On a GPU, FSDP2's sharded
    # gradients are views of its reduce-scatter output, allocated on the reduce-scatter stream: freed, that block
    # stays reserved in the stream's pool for the next reduction, where the forward cannot use it.
    # A hook before zero_grad keeps them through the forward only: Lightning's zero_grad drops them before backward,
    # unless a pipeline's schedule, which runs backward inside the training step, keeps them beside this step's.
    through = ddp or (c.pp == 1 and c.microbatches > 1) or (cuda and fsdp)
    earlier = (grads if through or c.holds_previous_grads else 0.0,
               grads if through or (c.holds_previous_grads and c.pp > 1) else 0.0)
    # FSDP2 accumulates unsynced gradients unsharded (pipeline stages too): each local stage's from its first
    # backward of the step on, counted per block of the stage. A pipeline stage's plain gradients appear the same
    # way; where the previous step's are held, this step's accumulate beside them.
    blocks = rank_blocks(spec, c, rank)
    block_grads = local * FP32 / sum(blocks) if fsdp and c.zero and c.microbatches > 1 else 0.0
    if c.pp > 1:
        block_grads = (local if fsdp and c.zero else sharded) * FP32 / sum(blocks)
    beside = c.pp > 1 and c.holds_previous_grads

    last = rank == c.pp - 1
    tokens = c.micro_batch * seq / c.cp
    autocast = eager_autocast(c, p)
    layer = lambda mode: tokens * activation_elements(spec, c, mode, autocast) * p.act_bytes  # noqa: E731
    # Each forward keeps its stage's blocks' activations until its backward, in the schedule's order.
    states = _states(c.pp, c.microbatches, c.virtual, c.schedule, rank, c.virtual - 1 if last else -1, blocks)
    kept = max(kept for kept, *_ in states[0]) * layer(c.checkpointing)
    # While a layer's backward runs it holds its MLP's gradient temporaries (the gate's and the up projection's),
    # and a checkpointed layer first recomputes what it did not keep. Under torch's pipeline schedules a rank was
    # measured to hold about one layer-microbatch beyond the schedule's in-flight count.
    mlp_width = spec.ffn_hidden * (spec.top_k if spec.n_expert else 1) / c.tp
    # Attention's backward runs after the MLP's, so the larger of the two working sets counts.
    working = max(2 * tokens * mlp_width * p.act_bytes, ring_attention_backward_bytes(spec, c, tokens))
    if c.checkpointing != "none":
        working += layer("none") - layer(c.checkpointing)
    if c.pp > 1:
        working += layer("none")
    # The loss's fp32 logits: log-softmax's output and, on a GPU, the two fp32 gradients of its backward (a
    # sampled host peak sees them one at a time). Sharded by vocabulary under a tensor-parallel loss.
    vocab = spec.vocab / c.tp if c.loss_parallel else spec.vocab
    copies = 3 if cuda else 2
    logits = copies * tokens * vocab * FP32 + 3 * tokens * spec.hidden * p.act_bytes if last else 0.0
    buffers = 0.0
    if c.pp > 1:
        stages = [rank + k * c.pp for k in range(c.virtual)]
        receives = sum((s > 0) + (s < c.pp * c.virtual - 1) for s in stages)  # activations in, gradients in
        # A stage boundary under sequence parallelism carries each rank's sequence shard.
        hidden_io = tokens * spec.hidden * p.act_bytes / (c.tp if c.sequence_parallel else 1)
        buffers = receives * c.microbatches * hidden_io + 2 * in_flight(c, rank) * hidden_io
    activations = kept + working
    # The caching allocator keeps the segments a layer's forward temporaries were carved from; the loss's logits
    # are larger than any of them, so they take new segments and the cached ones stay reserved.
    loss = logits + (working if cuda else 0.0)
    outputs = tokens * vocab * p.act_bytes if c.keeps_outputs and c.pp > 1 else 0.0
    forward_held, backward_held = _walk_schedule(
        states, layer(c.checkpointing), block_grads, earlier, (loss, logits), outputs, beside)
    # The reduction's buffer (one unit's gradient) exists only in backward.
    base = master + gathered + optimizer + buffers
    forward_end = base + forward_held
    # Autocast's cache of weight copies is cleared when the training step's forward leaves autocast; in backward
    # only the copies the graph saved remain, none for a recomputed block. A pipeline's schedule runs backward
    # inside the step, cache and all.
    if c.pp == 1:
        base -= weight_copies * RECOMPUTED_SHARE[c.checkpointing]
    during = max(forward_end, base + reduce_buffer + working + max(backward_held, grads))
    # AdamW steps in place: LLMParallelStrategy runs torch's fused kernel (fused_optimizer=True), which, unlike
    # torch's GPU default foreach, makes no temporary as large as a moment.
    step = master + grads + optimizer
    kept_outputs = outputs * c.microbatches if last else 0.0
    return MemoryEstimate(parameters=master, gathered=gathered, gradients=grads, optimizer=optimizer,
                          activations=activations, logits=logits + kept_outputs, buffers=buffers + reduce_buffer,
                          peak=max(during, step), rank=rank)
