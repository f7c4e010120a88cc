"""Pipeline options, validated up front, and the set-up that turns a LightningModule into local stages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch.distributed.device_mesh import DeviceMesh

from lightning_llmpar.modeling.hidden_states import apply_stage_hidden_states
from lightning_llmpar.modeling.structure import BlockStack, find_block_stack, has_forward, mark_block_stack
from lightning_llmpar.modeling.ties import TiedCopies, find_tied_weights
from lightning_llmpar.pipeline.check import check_split, checkable, run_whole
from lightning_llmpar.pipeline.runner import PipelineRunner
from lightning_llmpar.pipeline.split import outside_owners, split_model, stage_costs, stage_finder
from lightning_llmpar.pipeline.stage_state import warn_on_partial_state_dicts
from lightning_llmpar.pipeline.stages import SCHEDULES, V_SCHEDULES, StageLayout, plan_stages
from lightning_llmpar.tensor_parallel.rng import separate_stage_streams

__all__ = ["PipelineConfig", "build_pipeline", "start_training", "ZERO_BUBBLE_SCHEDULES"]

# Split backward (separate input- and weight-gradient passes) interleaves with FSDP2's re-sharding
# after forward in a way that loses or corrupts gradients: measured wrong (loss off by 1e-2) with
# zero_stage=3 and exact with zero_stage 0-2, for all three.
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class PipelineConfig:
    degree: int = 1
    schedule: str = "Interleaved1F1B"
    microbatches: int = 2
    virtual_stages: int = 1
    split_points: tuple[int, ...] | None = None

    @classmethod
    def validated(
        cls,
        degree: int,
        schedule: str,
        microbatches: int | None,
        virtual_stages: int | None,
        split_points: list[int] | None,
        zero_stage: int = 0,
    ) -> PipelineConfig:
        names = {k.lower(): k for k in SCHEDULES}
        if not isinstance(schedule, str) or schedule.lower() not in names:
            raise ValueError(f"pipeline_schedule={schedule!r} is not one of {list(SCHEDULES)}.")
        schedule = names[schedule.lower()]
        if degree > 1 and zero_stage == 3 and schedule in ZERO_BUBBLE_SCHEDULES:
            raise ValueError(
                f"pipeline_schedule={schedule!r} with zero_stage=3 gives wrong gradients (split weight/input"
                f" backward against FSDP2 re-sharding). Use zero_stage 0, 1 or 2 with {schedule}, or keep"
                " zero_stage=3 with Interleaved1F1B, 1F1B, GPipe or LoopedBFS."
            )
        needed = SCHEDULES[schedule]
        if virtual_stages is None:
            virtual_stages = needed if needed is not None else 2
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"pipeline_virtual_stages must be a positive integer, got {virtual_stages!r}.")
        if needed is not None and virtual_stages != needed:
            raise ValueError(
                f"pipeline_schedule={schedule!r} runs {needed} stage(s) per rank, but pipeline_virtual_stages="
                f"{virtual_stages}. Set pipeline_virtual_stages={needed} or pick a multi-stage schedule"
                " (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble)."
            )
        if needed is None and virtual_stages < 2:
            raise ValueError(
                f"pipeline_schedule={schedule!r} interleaves several stages per rank; pipeline_virtual_stages"
                f"={virtual_stages} must be >= 2 (or use pipeline_schedule='1F1B' for one stage per rank)."
            )
        if microbatches is None:
            microbatches = 2 * degree
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"pipeline_microbatches must be a positive integer, got {microbatches!r}.")
        if degree > 1 and microbatches < degree:
            raise ValueError(
                f"pipeline_microbatches={microbatches} is smaller than pipeline_parallel={degree}: some stages"
                f" would never work at the same time. Use at least {degree} microbatches."
            )
        if split_points is not None:  # (given with pipeline_parallel=1 it was refused before this)
            stages = degree * virtual_stages
            points = list(split_points) if isinstance(split_points, (list, tuple)) else []
            # (A string or floats ran: '2' became ['2'], and 2.5 cut between blocks nowhere in particular.)
            if len(points) != stages - 1 or not all(isinstance(p, int) and not isinstance(p, bool) for p in points) \
                    or points != sorted(set(points)) or min(points) < 1:
                raise ValueError(
                    f"pipeline_split_points={split_points!r} must be a list of {stages - 1} strictly increasing block"
                    f" indices >= 1 (where stages 1..{stages - 1} of {stages} start), e.g. {list(range(1, stages))}."
                )
        return cls(degree, schedule, microbatches, virtual_stages, tuple(split_points) if split_points else None)


def build_pipeline(
    module: LightningModule,
    config: PipelineConfig,
    mesh: DeviceMesh,
    device: torch.device,
    tokens: Any = None,
    param_dtype: torch.dtype | None = None,
    check: Callable[[], Any] | None = None,
) -> PipelineRunner:
    """Split ``module`` into this rank's stages (removing the rest) and return the runner that steps them."""
    pp_mesh = mesh["pp"]
    stack = find_block_stack(module)
    if stack is None:
        raise ValueError(
            "Pipeline parallelism needs the model's blocks in one nn.ModuleList, nn.ModuleDict or nn.Sequential; none"
            f" was found in {type(module).__name__}. Name it with block_stack='...' (see docs/model-convention.md)."
        )
    containers = [n for n, b in zip(stack.names(), stack.modules()) if not has_forward(b)]
    if containers:
        raise ValueError(
            f"Pipeline parallelism enters and leaves each stage at a block of '{stack.prefix}', but its blocks (e.g."
            f" '{containers[0]}') are containers without a forward that the model never calls. Name a stack of blocks"
            " its forward calls with block_stack='...', or train this model with tensor and data parallelism."
        )
    _refuse_parameters_beside_the_stack(module, stack)
    router = next((m for m in module.modules() if getattr(getattr(m, "config", None), "output_router_logits", False)), None)
    if router is not None:  # transformers' MoE models (Mixtral, Qwen-MoE, ...)
        raise ValueError(
            f"{type(router).__name__} returns its router logits (output_router_logits=True) for transformers'"
            " load-balancing loss, which is computed over every layer's logits at once; under pipeline parallelism the"
            " last stage holds only its own layers', so that loss and the routers' gradients would not be one"
            " process's. Set output_router_logits=False in the model's config, or train it with expert, tensor and"
            " data parallelism (pipeline_parallel=1)."
        )
    num_stages = config.degree * config.virtual_stages
    _non_reentrant_checkpointing(module)
    with checkable(module) as real:
        # The user's step, whole (which also shows what runs before and after the blocks) and then stage by
        # stage, before anything is split.
        reference = run_whole(module, stack, check) if check is not None and real else None
        stack = reference.stack if reference is not None else stack
        apply_stage_hidden_states(module, stack.blocks)  # transformers' output_hidden_states, split check on
        costs, first, last = stage_costs(module, stack)
        ranges = plan_stages(costs, num_stages, first_extra=first, last_extra=last, split_points=config.split_points)
        replicate = check_split(module, reference, ranges, check) if reference is not None else False
    before = _run_everywhere(module, stack, config) if _agreed(replicate, device, pp_mesh.get_group()) else []
    # What runs after the split (tensor parallelism, checkpointing) takes this stack too: on a rank's part of the
    # model another list may hold more (Zamba2's per-layer adapter lists), and would be taken for the blocks.
    mark_block_stack(module, stack.prefix)
    layout = StageLayout(config.degree, config.virtual_stages, config.schedule in V_SCHEDULES, ranges)
    tied = find_tied_weights(module)
    stage_of = stage_finder(module, stack, layout)
    # Named on the whole model, alike on every rank (the split leaves each rank a different part of it).
    replicas = [n for n, _ in module.named_parameters() if any(n.startswith(b + ".") for b in before)]
    whole = list(module.state_dict())
    parts, swaps = split_model(module, stack, layout, pp_mesh.get_local_rank(), tied, param_dtype, bool(before))
    warn_on_partial_state_dicts(module, whole)
    ties = TiedCopies.build(module, tied, stage_of, layout.rank_of, mesh, replicas)
    return PipelineRunner(
        module, stack.blocks, layout, parts, swaps, pp_mesh, device, config.schedule, config.microbatches, ties, tokens
    )


def _non_reentrant_checkpointing(module: LightningModule) -> None:
    """transformers' gradient checkpointing asked to be reentrant (``gradient_checkpointing_kwargs={"use_reentrant":
    True}``) cannot take the ``inputs=`` a stage's backward passes (torch refuses it in the first step): the same
    recomputation, non-reentrant."""
    for m in module.modules():
        func = getattr(m, "_gradient_checkpointing_func", None)
        if isinstance(func, partial) and func.keywords.get("use_reentrant"):
            m._gradient_checkpointing_func = partial(func.func, *func.args, **{**func.keywords, "use_reentrant": False})


def _refuse_parameters_beside_the_stack(module: LightningModule, stack: BlockStack) -> None:
    """A module that holds the stack and parameters of its own (a learned position table or class token on the
    model itself, timm's ViT): a stage cannot take them without the whole module. Said as it is, before the split
    check would blame the blocks for reading them."""
    before, after = outside_owners(module, stack)
    for owner in before + after:
        if owner == "" or stack.prefix.startswith(owner + "."):
            own = [n for n, _ in module.get_submodule(owner).named_parameters(recurse=False)]
            where = f"'{owner}'" if owner else f"The LightningModule {type(module).__name__}"
            raise ValueError(
                f"Pipeline split: {where} holds parameters of its own ({', '.join(own[:4])}) besides the blocks of"
                f" '{stack.prefix}', so no stage can hold them apart from the whole module. Move them into a module"
                " of their own that the forward calls before or after the blocks (an nn.Embedding for learned"
                " positions, a small nn.Module holding a class token), or train without pipeline parallelism"
                " (pipeline_parallel=1); tensor and data parallelism take it."
            )


def _run_everywhere(module: LightningModule, stack: BlockStack, config: PipelineConfig) -> list[str]:
    """The modules before the stack, which the split check found the blocks reading: they run on every rank. Refuse
    what cannot take that, before anything is split."""
    before = outside_owners(module, stack)[0]
    around = [b for b in before if stack.prefix.startswith(b + ".")]
    if around:
        raise ValueError(
            f"Pipeline split: the blocks of '{stack.prefix}' read values computed before the stack, so the modules"
            f" computing them would run on every pipeline rank, but '{around[0]}' holds parameters of its own and the"
            " blocks too: it cannot run apart from them. Train this model without pipeline parallelism"
            " (pipeline_parallel=1); tensor and data parallelism take it."
        )
    if before and config.virtual_stages > 1:
        raise ValueError(
            f"Pipeline split: the blocks of '{stack.prefix}' or the step after them read values that {_few(before)}"
            " compute before the stack (per-layer inputs, the embeddings, a frozen teacher's logits), so those"
            " modules run on every pipeline rank, their gradients summed over the ranks."
            f" pipeline_schedule={config.schedule!r} runs {config.virtual_stages} stages per rank, which cannot share"
            " them: set pipeline_schedule='1F1B' (or 'GPipe'), call a model the step does not train after the blocks"
            " instead of before them, or train without pipeline parallelism (pipeline_parallel=1)."
        )
    return before


def _agreed(flag: bool, device: torch.device, group: Any) -> bool:
    """``flag`` if any pipeline rank's check set it: every rank must split alike."""
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def _few(names: list[str]) -> str:
    return ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_train_batches(runner: PipelineRunner, config: PipelineConfig, sizes: Any) -> None:
    """Before the first step: every training batch must split into microbatches; the configured count must divide
    the regular batch, and an epoch's short last batch needs a count the schedule takes."""
    for size, last in sizes:
        if size % config.microbatches:
            raise ValueError(
                f"Batch size {size} is not divisible by pipeline_microbatches={config.microbatches}. Use a batch size"
                f" that is a multiple of {config.microbatches}, or change the microbatches."
            )
        if last:
            runner.microbatches_for(last, training=True)


def start_training(runner: PipelineRunner, config: PipelineConfig, sizes: Any) -> None:
    """Before the first training step: the batches checked, and this rank's dropout on its stage's own stream."""
    check_train_batches(runner, config, sizes)
    separate_stage_streams(runner.pp_rank)
