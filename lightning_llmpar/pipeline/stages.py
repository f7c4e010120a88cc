"""Pipeline stages: which schedules exist, how blocks are balanced into stages, and which rank runs which stage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    RECV_B,
    REDUCE_GRAD,
    SEND_B,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

_BACKWARD = (FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, SEND_B, RECV_B, REDUCE_GRAD)

__all__ = ["SCHEDULES", "V_SCHEDULES", "StageLayout", "bubble_fraction", "build_schedule", "plan_stages"]

# Name -> stages per rank it needs (None: any number >= 2).
SCHEDULES: dict[str, int | None] = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": None,
    "LoopedBFS": None,
    "InterleavedZeroBubble": None,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}
# Schedules that place stages in a V (rank r holds stages r and 2p-1-r) instead of round-robin.
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class StageLayout:
    """Which blocks each stage holds and which stages each pipeline rank runs."""

    pp: int
    stages_per_rank: int
    v_shape: bool
    block_ranges: tuple[tuple[int, int], ...]  # per stage: [start, stop) into the block stack

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        if self.v_shape:
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]


def plan_stages(
    block_costs: Sequence[int],
    num_stages: int,
    *,
    first_extra: int = 0,
    last_extra: int = 0,
    split_points: Sequence[int] | None = None,
) -> tuple[tuple[int, int], ...]:
    """Contiguous block ranges per stage that minimise the most expensive stage.

    The cost of a stage is the parameters it holds; the first stage also pays for the embeddings and
    the last for the norm and head (``first_extra``/``last_extra``). ``split_points`` (block indices
    where stages 1..S-1 start) overrides the balancing.
    """
    n = len(block_costs)
    if n < num_stages:
        raise ValueError(
            f"The model has {n} blocks but the pipeline needs {num_stages} stages (pipeline_parallel x"
            f" virtual stages); every stage needs at least one block. Lower pipeline_parallel or"
            f" pipeline_virtual_stages, or use a deeper model."
        )
    if split_points is not None:
        points = list(split_points)
        if len(points) != num_stages - 1 or points != sorted(set(points)) or not all(0 < p < n for p in points):
            raise ValueError(
                f"pipeline_split_points={points} must be {num_stages - 1} strictly increasing block indices"
                f" in 1..{n - 1} (where stages 1..{num_stages - 1} start) for {num_stages} stages of {n} blocks."
            )
        bounds = [0, *points, n]
        return tuple((bounds[i], bounds[i + 1]) for i in range(num_stages))
    prefix = [0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, start: int, stop: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == num_stages - 1 else 0)
        return prefix[stop] - prefix[start] + extra

    inf = float("inf")
    # best[s][i]: minimal max-cost of placing blocks [0, i) into stages 0..s-1.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    ranges, i = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][i]
        ranges.append((j, i))
        i = j
    return tuple(reversed(ranges))


def build_schedule(
    name: str, stages: list[PipelineStage], microbatches: int, loss_fn: Any, layout: StageLayout, training: bool = True
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    if not training and not layout.v_shape:
        # Forward only: every schedule computes the same; these take any number of microbatches (an evaluation
        # batch may hold fewer samples than there are stages).
        name = "GPipe" if layout.stages_per_rank == 1 else "LoopedBFS"
    cls = get_schedule_class(name)
    # scale_grads=False: loss_fn already divides by microbatches x accumulation, which stays right
    # under Lightning's accumulate_grad_batches (the schedule's own scaling does not know about it).
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule = cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    if not training and layout.v_shape:  # no other schedule places its stages so (the others: above)
        _forward_only(schedule)
    return schedule


def _forward_only(schedule: PipelineScheduleMulti) -> None:
    """Keep only the forward half of ``schedule``'s lowered program: its forward computations with their sends and
    receives, and FSDP's unshards and reshards. torch's ``eval`` runs the whole program with backward turned off, and a
    V-shaped schedule's backward hand-over between a rank's two stages then fails ("can't steal_bwd_input if this
    stage doesn't have backward"). Every rank drops the same backward sends and receives, so the pairs still match;
    the forward ones keep their order, and dropping work only removes waits."""
    for rank, actions in schedule.pipeline_order_with_comms.items():
        kept = []
        for action in actions:
            if action.computation_type == OVERLAP_F_B:  # DualPipeV: one forward and one backward, overlapped
                kept += [a for a in action.sub_actions or () if a.computation_type == FORWARD]
            elif action.computation_type not in _BACKWARD:
                kept.append(action)
        schedule.pipeline_order_with_comms[rank] = kept


def bubble_fraction(actions: list[tuple], window: tuple[float, float]) -> float:
    """Idle share of one rank in one step: 1 - (time inside stage compute) / (step time)."""
    start, end = window
    busy = sum(t1 - t0 for *_, t0, t1 in actions)
    return max(0.0, 1.0 - busy / max(end - start, 1e-9))
