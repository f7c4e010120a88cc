"""The set-up, in one place: how LLMParallelStrategy turns the user's module into this rank's part of the model.

``compose`` runs once per module, in the only order that works; each step needs the one before:

1. The block stack the user named is marked, so every later step finds the same one; packed documents get their
   attention masks in transformers models.
2. Module swaps of the precision plugin (FP8 linears) come before anything is split or sharded.
3. Token counting and context parallelism: they change what a step computes, not the weights.
4. The pipeline split: each rank keeps only its stages, so nothing else is built for layers it drops.
5. ``parallelize``: tensor parallelism -> experts -> activation checkpointing -> compile -> FSDP2 / DDP.
6. Gradient compression on the data-parallel units FSDP2 made; torchmetrics metrics sync over the ranks of
   different data, not tensor-parallel copies (``training.sync_groups``).
7. Memory for this rank's shards (meta-device init), pretrained weights read per rank, tied copies made equal.

The sharding backend then wraps what ``compose`` returned (see ``data_parallel.backend``); the strategy only
calls the two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_llmpar.activation_checkpointing.policy import ActivationCheckpointing, CheckpointPlan
from lightning_llmpar.checkpointing.hf_checkpoint import load_hf_checkpoint
from lightning_llmpar.checkpointing.litgpt_checkpoint import load_litgpt_checkpoint
from lightning_llmpar.context_parallel import ContextParallel, apply_context_parallel
from lightning_llmpar.data_parallel.compression.hooks import GradientCompression, apply_gradient_compression
from lightning_llmpar.layout import ParallelLayout
from lightning_llmpar.modeling.hidden_states import apply_hidden_states_gather
from lightning_llmpar.modeling.materialize import materialize
from lightning_llmpar.modeling.structure import mark_block_stack
from lightning_llmpar.modeling.ties import find_tied_weights
from lightning_llmpar.parallelize import ParallelConfig, Parallelized, parallelize
from lightning_llmpar.pipeline.runner import PipelineRunner
from lightning_llmpar.pipeline.setup import build_pipeline
from lightning_llmpar.strategies.options import StrategyOptions
from lightning_llmpar.tensor_parallel import Packing
from lightning_llmpar.tensor_parallel.entries import check_plan_matches
from lightning_llmpar.training.documents import apply_document_masking, refuse_packed_padding
from lightning_llmpar.training.ignore_index import IgnoreIndex
from lightning_llmpar.training.loss_normalization import (
    PaddedMeanWarning,
    TokenNormalizer,
    count_target_tokens,
    label_counter,
)
from lightning_llmpar.training.same_batch import SameBatchCheck
from lightning_llmpar.training.sync_groups import apply_metric_groups

__all__ = ["Composed", "SetupContext", "compose", "composed_before", "fill_weights", "parallel_config"]

_DONE = "_llmpar_composed"  # on the LightningModule: what compose made of it


@dataclass(frozen=True)
class SetupContext:
    """What the set-up reads, fixed before it starts: the layout and its mesh, the strategy's validated options,
    this rank's device, the precision plugin, and what the Trainer contributes."""

    layout: ParallelLayout
    mesh: DeviceMesh
    options: StrategyOptions
    device: torch.device
    precision: Precision
    checkpointing: ActivationCheckpointing | None = None
    # The user's training step on one sample, for the pipeline split check (None: no check).
    split_check: Callable[[], Any] | None = None


@dataclass
class Composed:
    """What the set-up left behind for the steps: the pipeline runner, what was parallelized (data-parallel units,
    packings, experts), compression, context parallelism and token counting."""

    layout: ParallelLayout
    config: ParallelConfig
    parallelized: Parallelized = field(default_factory=Parallelized)
    runner: PipelineRunner | None = None
    compression: GradientCompression | None = None
    context_parallel: ContextParallel | None = None
    tokens: TokenNormalizer | None = None
    padded_mean: PaddedMeanWarning | None = None
    same_batch: SameBatchCheck | None = None
    hf_documents: bool = False  # transformers models whose forwards mask packed documents (training.documents)
    checkpointing: CheckpointPlan | None = None  # the activation checkpointing applied (None: none)
    ignore: IgnoreIndex = field(default_factory=lambda: IgnoreIndex(torch.device("cpu"), looks=0))

    @contextmanager
    def step(self, method: str, batch: Any) -> Iterator[None]:
        """Around a step on ``batch``. A training batch first: the same on every rank of the replica (the first
        ones compared), its valid targets counted (``loss_normalization='tokens'``; a pipeline's runner counts its
        own microbatches). During the first steps the loss's ignore index is read from its calls (the count is
        settled by it when used); then a batch's padding is looked for (``'mean'``)."""
        training = method == "training_step"
        if training:
            if self.hf_documents and isinstance(batch, dict):  # whole rows (a context-parallel forward sees a part)
                refuse_packed_padding(batch.get("position_ids"), batch.get("attention_mask"))
            if self.same_batch is not None:
                self.same_batch.see(batch)
            if self.tokens is not None:
                self.tokens.begin_step()
                if self.runner is None:  # (a pipeline's last stage counts each microbatch after its loss)
                    self.tokens.add(batch)
        with self.ignore.watch(training):
            yield
        if self.padded_mean is not None and method != "predict_step":
            self.padded_mean.see(batch, "training" if training else "evaluation", self.ignore.noted())

    def aliases(self) -> dict[str, str]:
        """Copies of tied weights on pipeline stages: local name -> the name one process gives the weight."""
        ties = self.runner.ties if self.runner is not None else None
        return ties.aliases() if ties is not None else {}


def parallel_config(options: StrategyOptions, precision: Precision) -> ParallelConfig:
    """The per-technique options, with what the precision plugin decides (its FSDP2 mixed-precision policy, whether
    it needs FSDP2 even on one rank, whether it is plain fp32) filled in before the config is built."""
    policy = precision.mp_policy() if hasattr(precision, "mp_policy") else None
    plain = policy is None and getattr(precision, "compute_dtype", torch.float32) in (torch.float32, torch.float64)
    return ParallelConfig(
        sequence_parallel=options.sequence_parallel, tp_plan=dict(options.tp_plan), cpu_offload=options.cpu_offload,
        mp_policy=policy, always_shard=bool(getattr(precision, "needs_sharding_wrapper", False)),
        plain_precision=plain, gradient_compression=options.compression,
        expert_capacity_factor=options.expert_capacity_factor, compile=options.compile,
        loss_parallel=options.loss_parallel,
    )


def _checkpoint_plan(ctx: SetupContext) -> CheckpointPlan | None:
    plan = ctx.checkpointing.plan if ctx.checkpointing is not None else None
    return plan if plan is not None and plan.mode != "none" else None


def composed_before(module: nn.Module, ctx: SetupContext, fitting: bool) -> Composed | None:
    """What an earlier ``compose`` made of ``module`` (fit, then validate/test/predict on the same module, or fit
    again). A module is parallelized once: a run that asks for other settings is refused, not given the old ones
    (activation checkpointing only when it fits: evaluation runs no backward)."""
    done: Composed | None = getattr(module, _DONE, None)
    if done is None:
        return None
    if done.layout != ctx.layout:
        raise ValueError(
            f"This LightningModule was already parallelized as {done.layout}; it cannot be re-parallelized as"
            f" {ctx.layout}. Build a new module, or load a checkpoint into a fresh one."
        )
    asked = parallel_config(ctx.options, ctx.precision)
    changed = [f"{f.name}={getattr(done.config, f.name)!r} (this run: {getattr(asked, f.name)!r})"
               for f in fields(asked) if getattr(asked, f.name) != getattr(done.config, f.name)]
    if fitting and _checkpoint_plan(ctx) != done.checkpointing:
        changed.append(f"activation checkpointing {done.checkpointing} (this run: {_checkpoint_plan(ctx)})")
    if changed:
        raise ValueError(
            f"This LightningModule was already parallelized with {'; '.join(changed)}. A module is parallelized"
            " once: build a new module for other settings, or load a checkpoint into a fresh one."
        )
    return done


def fill_weights(module: nn.Module, options: StrategyOptions, device: torch.device,
                 packings: Mapping[str, Packing] | None = None, aliases: Mapping[str, str] | None = None) -> None:
    """Give a module built on the meta device its memory and read the pretrained weights the options name (this
    rank's shards of a composed module; the whole of one the DeepSpeed engine takes)."""
    materialize(module, device, find_tied_weights(module), packings)
    if options.hf_checkpoint is not None:
        load_hf_checkpoint(module, options.hf_checkpoint, packings, aliases)
    if options.litgpt_checkpoint is not None:
        load_litgpt_checkpoint(module, options.litgpt_checkpoint, packings, aliases)


def compose(module: nn.Module, ctx: SetupContext) -> Composed:
    """Parallelize ``module`` in place for this rank (the steps and their order are in the module docstring)."""
    options, layout, mesh = ctx.options, ctx.layout, ctx.mesh
    if options.block_stack is not None:
        mark_block_stack(module, options.block_stack)
    if layout.tp > 1:  # on the whole model: a pipeline stage holds only some of the modules a plan names
        check_plan_matches(module, options.tp_plan)
    hf_documents = apply_document_masking(module) > 0  # packed documents in transformers models (training.documents)
    if hasattr(ctx.precision, "convert_before_parallelism"):
        ctx.precision.convert_before_parallelism(module)
    done = Composed(layout, parallel_config(options, ctx.precision), hf_documents=hf_documents,
                    checkpointing=_checkpoint_plan(ctx))
    default_count = options.count_tokens is count_target_tokens
    if default_count or options.count_tokens is None or layout.cp > 1:  # something counts the loss's targets
        done.ignore = IgnoreIndex(ctx.device, decisive=default_count or layout.cp > 1)
    if options.count_tokens is not None:
        # Context-parallel ranks count the same whole batch (each weighs its own part, see context_parallel).
        # The default counter counts labels as the model's loss does (shifted for a causal LM, all for T5 or BERT)
        # and skips those its loss ignores.
        count = label_counter(module, done.ignore) if default_count else options.count_tokens
        done.tokens = TokenNormalizer(count, layout.tp * layout.cp, layout.dp, ctx.device,
                                      done.ignore.noted if default_count else None)
    else:
        microbatches = options.pipeline.microbatches if layout.pp > 1 else 1
        parts = [f"{n} {what}" for n, what in ((layout.dp, "data-parallel ranks"), (microbatches, "microbatches")) if n > 1]
        done.padded_mean = PaddedMeanWarning(" x ".join(parts)) if parts else None
    axes = (("tensor", "tp", layout.tp), ("context", "cp", layout.cp), ("pipeline", "pp", layout.pp))
    replica = {name: mesh[axis].get_group() for name, axis, degree in axes if degree > 1}
    if replica:  # ranks that must read one batch (see training.same_batch)
        data = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        done.same_batch = SameBatchCheck(replica, ctx.device, {"num_replicas": data.size(), "rank": data.get_local_rank()})
    if layout.cp > 1:
        done.context_parallel = apply_context_parallel(module, mesh["cp"], options.context_parallel_mode)
        done.context_parallel.ignore_index = done.ignore.noted
    stage_roots: list[nn.Module] = []
    if layout.pp > 1:
        policy = done.config.mp_policy
        done.runner = build_pipeline(
            module, options.pipeline, mesh, ctx.device, done.tokens,
            policy.param_dtype if policy is not None else None, check=ctx.split_check,
        )
        stage_roots = list(done.runner.stage_modules.values())
        done.runner.context_parallel = done.context_parallel
        done.runner.scale_loss = getattr(ctx.precision, "scale_loss", None)
    done.parallelized = parallelize(module, layout, mesh, done.config, stage_roots, ctx.checkpointing)
    if (runner := done.runner) is not None and done.parallelized.expert_parallel is not None:
        done.parallelized.expert_parallel.recording = lambda: not runner.inferring
    if layout.tp > 1 and done.config.sequence_parallel:  # transformers' output_hidden_states (modeling.hidden_states)
        apply_hidden_states_gather(module, mesh["tp"])
    if done.config.gradient_compression is not None:
        done.compression = apply_gradient_compression(
            done.parallelized.dp_roots, mesh, layout, done.config.gradient_compression
        )
    apply_metric_groups(module, layout, mesh)
    setattr(module, _DONE, done)
    # Weights built on the meta device get memory now, for this rank's shards only (ties as they stand after
    # sharding: to_empty gives every name its own memory).
    fill_weights(module, options, ctx.device, done.parallelized.packings, done.aliases())
    if done.runner is not None and done.runner.ties is not None:
        done.runner.ties.make_equal()
    return done
