"""One point of the search: the degrees, ZeRO stage, checkpointing and batching of a run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CHECKPOINTING", "Candidate", "in_flight", "schedule_actions"]

# "selective" keeps the attention kernel's output (this project's default save policy); "selective_op" is
# torchtitan's op policy (every odd matmul's output and the attention output); "every_2" recomputes every
# second block whole. The search tries the first three; the other two are for describing a given run.
Checkpointing = Literal["none", "selective", "full", "selective_op", "every_2"]
CHECKPOINTING: tuple[Checkpointing, ...] = ("none", "selective", "full")
Float8 = Literal["tensorwise", "rowwise"]
StageSplit = Literal["balanced", "torchtitan"]


@dataclass(frozen=True)
class Candidate:
    """``micro_batch`` sequences go through the model at once on each data-parallel rank, ``microbatches`` times
    per optimizer step (the pipeline's microbatches, or gradient accumulation without a pipeline)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1  # ZeRO-0 replicates over all dp ranks; ZeRO 1-3 shard over dp / dp_replicate
    zero: int = 0
    checkpointing: Checkpointing = "none"
    micro_batch: int = 1
    microbatches: int = 1
    schedule: str = "none"  # pipeline schedule when pp > 1
    virtual: int = 1  # stages per pipeline rank
    sequence_parallel: bool = True
    compile: bool = False  # torch.compile per block: fused elementwise ops
    float8: Float8 | None = None  # torchao float8 linears in the blocks (the head stays bf16)
    async_tp: bool = False  # tensor-parallel collectives micro-pipelined with their matmuls
    fsdp_per_block: bool = False  # each block its own FSDP unit under a pipeline too (torchtitan), not the stage
    loss_parallel: bool = False  # the loss on vocabulary-sharded logits (torchtitan's default under TP)
    # The pipeline's last stage keeps every microbatch's output (the logits) until the step ends: torch's schedules
    # did before ``step(return_outputs=False)`` (torchtitan's 2024 runs); this strategy's pipeline does not.
    keeps_outputs: bool = False
    # How blocks are split into pipeline stages (``planner.split``): this strategy's parameter-balanced split, or
    # torchtitan's default, to describe its runs.
    stage_split: StageSplit = "balanced"
    # A pipeline step holds the previous step's gradients aside through its schedule while this step's accumulate:
    # this strategy's pipeline does under accumulate_grad_batches > 1, or when a hook reads gradients before
    # Lightning's zero_grad (training.zero_grad.zero_grad_follows). Otherwise it releases them first.
    holds_previous_grads: bool = False

    @property
    def float8_all_gather(self) -> bool:
        """Tensorwise float8 weights are gathered by FSDP in fp8 where FSDP shards over data-parallel ranks."""
        return self.float8 == "tensorwise" and self.zero > 0 and self.dp // self.dp_replicate > 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def shard(self) -> int:
        """Ranks parameter state is sharded over: FSDP shards over dp_shard x cp (cp ranks even at ZeRO-0)."""
        return (self.dp // self.dp_replicate if self.zero else 1) * self.cp

    @property
    def fsdp(self) -> bool:
        return self.dp * self.cp > 1

    def replicates(self, precision: str) -> bool:
        """Pure data parallelism in full precision runs on DDP, with no gathered copy (see data_parallel.replicate)."""
        return self.zero == 0 and self.dp > 1 and self.tp * self.pp * self.cp * self.ep == 1 and precision == "32-true"

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.microbatches

    def label(self) -> str:
        parts = [f"dp{self.dp}" + (f"(r{self.dp_replicate})" if self.zero and self.dp_replicate > 1 else ""),
                 f"tp{self.tp}" + ("" if self.sequence_parallel or self.tp == 1 else "-nosp"), f"pp{self.pp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        sched = f" {self.schedule}x{self.virtual}" if self.pp > 1 else ""
        batching = f"mb={self.micro_batch}x{self.microbatches}"
        extras = "".join(f" {name}" for name, on in (("compile", self.compile), (f"fp8-{self.float8}", self.float8),
                                                      ("async-tp", self.async_tp)) if on)
        return f"{' '.join(parts)} z{self.zero} ac={self.checkpointing} {batching}{sched}{extras}"


def in_flight(c: Candidate, rank: int) -> int:
    """Forwards (one microbatch through one of the rank's stages) whose activations pipeline rank ``rank`` holds
    at once, at most: the warm-up of torch's schedules plus the one in 1F1B's steady state."""
    n, pp, v = c.microbatches, c.pp, c.virtual
    if pp == 1:
        return 1
    if c.schedule == "GPipe":
        return n
    if c.schedule == "1F1B":
        return min(pp - rank, n)
    return min(_warmup(c, rank) + 1, n * v)


def _warmup(c: Candidate, rank: int) -> int:
    """Forwards a pipeline rank runs before its first backward, as torch's schedules count them (interleaved: its
    warm-up rule for looped schedules, also used for the others, approximately)."""
    n, pp, v = c.microbatches, c.pp, c.virtual
    if c.schedule == "GPipe":
        return n
    if c.schedule == "1F1B":
        return min(pp - rank, n)
    per_round = n // max(1, n // pp)
    return min((v - 1) * per_round + 2 * (pp - 1 - rank), n * v)


def schedule_actions(c: Candidate, rank: int) -> list[tuple[bool, int]]:
    """Pipeline rank ``rank``'s forwards and backwards in the order torch's schedule runs them, as (forward?, local
    stage); without a pipeline, each accumulated microbatch's forward then backward. After the warm-up's forwards
    come pairs of one forward and one backward, then the remaining backwards; looped schedules take rounds of
    ``pp`` microbatches per local stage, forwards in stage order and backwards in reverse (torch's
    ``_calculate_single_rank_operations``); 1F1B runs each backward before the next forward."""
    n, v = c.microbatches, c.virtual
    if c.pp == 1:
        return [(True, 0), (False, 0)] * n
    per_round = n // max(1, n // c.pp) if v > 1 else n
    warmup = _warmup(c, rank)
    forwards = [(True, (k // per_round) % v) for k in range(n * v)]
    backwards = [(False, v - 1 - (k // per_round) % v) for k in range(n * v)]
    # 1F1B (one stage per rank) runs each backward before the next forward; looped schedules the forward first.
    pairs = zip(backwards, forwards[warmup:]) if c.schedule == "1F1B" else zip(forwards[warmup:], backwards)
    return forwards[:warmup] + [a for pair in pairs for a in pair] + backwards[n * v - warmup:]
