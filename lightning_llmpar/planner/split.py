"""Blocks per pipeline stage, as the run will split the model.

Stages rarely hold the same number of blocks: this strategy balances parameters (``plan_stages``), so the stages
that also hold the embedding or the head get fewer blocks; torchtitan gives the first and last stages the base
count and the middle ones the remainder. A rank's memory and time follow its own stages, and the slowest rank
sets the pipeline's pace.
"""

from __future__ import annotations

from functools import lru_cache

from lightning_llmpar.data_parallel.fsdp import BUCKET_BYTES
from lightning_llmpar.pipeline.stages import plan_stages
from lightning_llmpar.planner.candidate import Candidate
from lightning_llmpar.planner.spec import ModelSpec

__all__ = ["rank_blocks", "rank_matmul_params", "rank_params", "stage_blocks"]

FP32 = 4  # bytes of an fp32 master weight or gradient


@lru_cache(maxsize=1024)
def _balanced(layers: int, block: int, first: int, last: int, stages: int) -> tuple[int, ...]:
    ranges = plan_stages([block] * layers, stages, first_extra=first, last_extra=last)
    return tuple(stop - start for start, stop in ranges)


def _torchtitan(layers: int, stages: int) -> tuple[int, ...]:
    """torchtitan's split when none is given (``generate_split_points``): the first stage takes the base count,
    the middle ones one more while the remainder lasts, the last what is left."""
    base, extra = divmod(layers, stages)
    counts = [base] + [base + (i < extra) for i in range(stages - 2)]
    return (*counts, layers - sum(counts))


def stage_blocks(spec: ModelSpec, c: Candidate) -> tuple[int, ...]:
    """Blocks of each of the ``pp x virtual`` stages, in order. ``c.stage_split``: "balanced" is this strategy's
    split (the parameters of each stage balanced, the embedding counted on the first and the head, a copy when
    tied, with the final norm on the last, as ``pipeline.split.stage_costs`` counts them); "torchtitan" is
    torchtitan's default split."""
    stages = c.pp * c.virtual
    if stages == 1:
        return (spec.n_layer,)
    if c.stage_split == "torchtitan":
        return _torchtitan(spec.n_layer, stages)
    head = spec.embed_params if spec.tied else spec.head_params
    return _balanced(spec.n_layer, spec.block_params, spec.embed_params, head + spec.other_params, stages)


def rank_blocks(spec: ModelSpec, c: Candidate, rank: int) -> tuple[int, ...]:
    """Blocks of each stage pipeline rank ``rank`` runs (stages are placed round-robin: ``rank + k x pp``)."""
    blocks = stage_blocks(spec, c)
    return tuple(blocks[rank + k * c.pp] for k in range(c.virtual))


def _block_matrices(spec: ModelSpec, c: Candidate) -> float:
    """One block's 2-D weights on one rank: dense ones split by tensor parallelism, experts by tensor and expert."""
    dense = spec.block_matrix_params - spec.block_expert_params
    return dense / c.tp + spec.block_expert_params / (c.tp * c.ep)


def rank_matmul_params(spec: ModelSpec, c: Candidate, rank: int) -> float:
    """Parameters of rank ``rank``'s matmuls: its blocks' matrices and, on the last rank, the output head (the
    embedding's weight when tied)."""
    head = (spec.embed_params if spec.tied else spec.head_params) / c.tp if rank == c.pp - 1 else 0.0
    return sum(rank_blocks(spec, c, rank)) * _block_matrices(spec, c) + head


def rank_params(spec: ModelSpec, c: Candidate, rank: int) -> tuple[float, float]:
    """Parameters pipeline rank ``rank`` holds (after tensor and expert splits: the embedding on the first rank, the
    head, a copy when tied, and the final norm on the last), and its largest FSDP unit."""
    block = _block_matrices(spec, c) + spec.block_params - spec.block_matrix_params
    stages = rank_blocks(spec, c, rank)
    layers = sum(stages)
    total = layers * block
    ends = 0.0
    if rank == 0:
        ends += spec.embed_params / c.tp
    if rank == c.pp - 1:
        head = spec.embed_params if (spec.tied and c.pp > 1) else spec.head_params  # a tied head is a copy
        ends += head / c.tp + spec.other_params
    # Blocks are FSDP units without a pipeline (grouped up to 25 MiB at ZeRO 0-2); with one, each stage is a unit.
    if c.pp > 1 and not c.fsdp_per_block:
        unit = max(stages) * block + ends
    elif c.zero < 3:
        unit = block * min(layers, max(1, BUCKET_BYTES // (block * FP32)))
    else:
        unit = block
    return total + ends, unit
