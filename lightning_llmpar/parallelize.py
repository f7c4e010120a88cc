"""The one place where techniques are composed, in the only order that works."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_llmpar.activation_checkpointing.policy import ActivationCheckpointing
from lightning_llmpar.data_parallel.compression.methods import CompressionConfig
from lightning_llmpar.data_parallel.fsdp import apply_data_parallel
from lightning_llmpar.data_parallel.replicate import apply_replicate, replicates
from lightning_llmpar.expert_parallel import ExpertParallel, apply_expert_parallel
from lightning_llmpar.layout import ParallelLayout
from lightning_llmpar.modeling.structure import find_block_stack
from lightning_llmpar.modeling.ties import find_tied_weights, retie
from lightning_llmpar.tensor_parallel import Packing, apply_tensor_parallel, infer_tp_plan
from lightning_llmpar.tensor_parallel.loss_parallel import LossParallel, VocabParallelHead
from lightning_llmpar.training.compile import apply_compile, check_no_dropout

__all__ = ["ParallelConfig", "Parallelized", "parallelize"]


@dataclass(frozen=True)
class ParallelConfig:
    """Per-technique options that are not degrees (those live in :class:`ParallelLayout`)."""

    sequence_parallel: bool = True
    tp_plan: Mapping[str, Any] = field(default_factory=dict)
    cpu_offload: bool = False
    mp_policy: MixedPrecisionPolicy | None = None
    # Apply FSDP2 even with one data-parallel rank: its policy is what casts fp32 master weights to the
    # compute dtype (BF16 true).
    always_shard: bool = False
    # The precision plugin computes in fp32/fp64 with no parameter casting (so never with always_shard) and no FP8
    # weights: nothing it needs from FSDP2, so pure data parallelism can run on DDP (see data_parallel.replicate).
    plain_precision: bool = True
    # Compresses the data-parallel gradient sync (see lightning_llmpar.data_parallel.compression.hooks).
    gradient_compression: CompressionConfig | None = None
    # Cut each expert at this multiple of its even share of a rank's tokens (see expert_parallel.dispatch).
    expert_capacity_factor: float | None = None
    # torch.compile each block (see training.compile).
    compile: bool = False
    # Keep the LM head's logits split over the vocabulary in training steps (see tensor_parallel.loss_parallel):
    # True (refuse other uses of them), 'auto' (gather them for other uses) or False.
    loss_parallel: bool | str = "auto"


@dataclass
class Parallelized:
    """What parallelization left behind that later steps need: the data-parallel roots, FSDP2's or DDP's (gradient
    sync, compression), and the fused parameters split per piece (checkpoints translate them back, see
    tensor_parallel.packing)."""

    dp_roots: list[nn.Module] = field(default_factory=list)
    packings: dict[str, Packing] = field(default_factory=dict)
    expert_parallel: ExpertParallel | None = None
    loss_parallel: LossParallel | None = None


def _vocab_parallel_heads(plan: Any, option: bool | str, pp: int) -> LossParallel | None:
    """With loss parallelism, the plan's LM heads keep their output split in training steps."""
    if option is False:
        return None
    if not plan.vocab_heads:
        if option is True and pp == 1:  # (a pipeline rank without the last stage has no head)
            raise ValueError(
                "loss_parallel=True keeps the LM head's output split over the vocabulary, but the tensor-parallel plan"
                " has no LM head split by vocabulary (a Linear onto the vocabulary outside the blocks; tp_plan may"
                " name it otherwise). Leave the head to the inferred plan, or set loss_parallel='auto' or False."
            )
        return None
    owner = LossParallel(strict=option is True)
    for name in plan.vocab_heads:
        plan.styles[name] = VocabParallelHead(owner)
    return owner


def parallelize(
    model: nn.Module,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    config: ParallelConfig,
    stage_roots: Sequence[nn.Module] = (),
    checkpointing: ActivationCheckpointing | None = None,
) -> Parallelized:
    """Apply tensor parallelism, then data parallelism (ZeRO via FSDP2), to ``model`` in place.

    Order matters. The pipeline split (done before this, see pipeline.split.split_model) comes
    first so each rank only shards what it keeps. Tensor parallelism comes next because FSDP2 shards
    the DTensors TP produced along the data-parallel axis (giving dp x tp parameters). Activation
    checkpointing belongs between the two so recomputation replays the sharded ops, and FSDP wraps
    last so its hooks see the final modules.
    """
    done = Parallelized()
    _check_compiled_checkpointing(layout, config, checkpointing)
    if layout.tp > 1:
        if config.compile:
            check_no_dropout(model)  # so the per-rank dropout streams, which compiled code cannot use, are not needed
        tied = find_tied_weights(model)
        plan = infer_tp_plan(model, layout.tp, sequence_parallel=config.sequence_parallel, user_plan=config.tp_plan)
        _warn_if_blocks_stay_whole(model, plan.styles, layout.tp)
        done.loss_parallel = _vocab_parallel_heads(plan, config.loss_parallel, layout.pp)
        apply_tensor_parallel(model, mesh["tp"], plan, rank_streams=not config.compile)
        retie(model, tied)  # sharding gave each user of a tied weight its own parameter
        done.packings = plan.packings
    expert_mesh, expert_dp_mesh = layout.expert_meshes(mesh) if layout.ep > 1 else (None, None)
    if layout.ep > 1 or config.expert_capacity_factor is not None:
        # After tensor parallelism, which split each expert along its FFN width: the expert split goes in front.
        done.expert_parallel = apply_expert_parallel(model, expert_mesh, config.expert_capacity_factor)
    # Blocks that break their graph (DTensor code under checkpointing, context-parallel attention, routed experts)
    # compile their forward before checkpointing wraps them; the others are compiled whole after it, before FSDP2's
    # hooks. See training.compile.
    forward_only = layout.tp > 1 or layout.cp > 1 or done.expert_parallel is not None
    if config.compile and forward_only:
        apply_compile(model, forward_only=True, static_shapes=layout.tp > 1)
    if checkpointing is not None:
        checkpointing.apply(model, mesh)
    if config.compile and not forward_only:
        apply_compile(model)
    if not (layout.dp * layout.cp > 1 or config.cpu_offload or config.always_shard):
        return done
    if replicates(layout, plain_precision=config.plain_precision, compression=config.gradient_compression is not None,
                  cpu_offload=config.cpu_offload):
        apply_replicate(model, mesh["dp_replicate"].get_group())
        done.dp_roots = [model]
        return done
    # FSDP shards over the context-parallel ranks too, so with context parallelism parameters are sharded even at
    # ZeRO-0.
    dp_mesh = layout.fsdp_mesh(mesh)
    if config.gradient_compression is not None and layout.zero_stage == 0:
        # FSDP2 on the size-1 dp_shard axis communicates nothing, so the compressed all-reduce hook
        # (applied by the caller) is the only gradient sync; see compression_hooks.
        dp_mesh = mesh["dp_shard"]
    kwargs = {"zero_stage": layout.zero_stage, "cpu_offload": config.cpu_offload, "mp_policy": config.mp_policy}
    if expert_dp_mesh is not None and done.expert_parallel is not None:
        # Expert weights differ across the ep ranks: their own units, data-parallel over the remaining ranks only.
        for experts in done.expert_parallel.experts.values():
            apply_data_parallel(experts, expert_dp_mesh, blocks=None, **kwargs)
    if stage_roots:
        # One FSDP unit per pipeline stage, none per block: nested units under the zero-bubble
        # schedules give wrong gradients, one unit per stage is exact under every schedule.
        for root in stage_roots:
            apply_data_parallel(root, dp_mesh, blocks=None, **kwargs)
        done.dp_roots = list(stage_roots)
        return done
    apply_data_parallel(model, dp_mesh, blocks=find_block_stack(model), **kwargs)
    done.dp_roots = [model]
    return done


def _check_compiled_checkpointing(layout: ParallelLayout, config: ParallelConfig,
                                  checkpointing: ActivationCheckpointing | None) -> None:
    """Under tensor parallelism a compiled block's forward runs inside an eager checkpoint (see training.compile);
    selective recomputation that keeps matmul outputs there fails in the first backward ("Tensor cached during
    selective activation checkpoint has been mutated"), measured with a transformers Llama at tp2."""
    plan = checkpointing.plan if checkpointing is not None else None
    if not (config.compile and layout.tp > 1 and plan is not None and plan.mode in ("selective", "budget")
            and plan.save != "attention"):
        return
    raise ValueError(
        f"ActivationCheckpointing(mode={plan.mode!r}, save={plan.save!r}) with compile=True and tensor_parallel="
        f"{layout.tp} fails in backward: a compiled block keeps no matmul outputs for selective recomputation under"
        " tensor parallelism. Use save='attention', mode='full' or 'every_k', or compile=False."
    )


def _warn_if_blocks_stay_whole(model: nn.Module, styles: Mapping[str, Any], tp: int) -> None:
    """The plan keeps a linear that fits no attention or MLP pattern whole: exact, but where that is every linear of
    the blocks (a per-head ModuleList of Linears), each rank holds and computes the whole blocks. Said once."""
    stack = find_block_stack(model)
    if stack is None or not stack.prefix:
        return
    inside = stack.prefix + "."
    split = [key.split("#", 1)[0] for key, style in styles.items() if style is not None]
    _warn_if_other_stacks_stay_whole(model, stack.prefix, split, tp)
    if any(key.startswith(inside) for key in split):
        return
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(inside)]
    if linears:
        rank_zero_warn(
            f"tensor_parallel={tp} splits nothing inside the blocks of '{stack.prefix}': their linears (e.g."
            f" '{linears[0]}') fit no attention or MLP layout the plan knows, so every rank holds and computes the"
            " whole blocks (exact, without the saving). Give their styles with tp_plan={...}"
            " (docs/model-convention.md), or train this model without tensor parallelism."
        )


def _warn_if_other_stacks_stay_whole(model: nn.Module, prefix: str, split: list[str], tp: int) -> None:
    """The plan splits one stack of blocks: another one outside it (an encoder-decoder's encoder, a vision tower)
    stays whole on every rank, exact but without the saving. Said once, naming it."""
    others = [n for n, m in model.named_modules()
              if isinstance(m, nn.ModuleList) and len(m) > 1 and n and n != prefix
              and not n.startswith(prefix + ".") and not prefix.startswith(n + ".")
              and all(sum(isinstance(x, nn.Linear) for x in block.modules()) >= 2 for block in m)
              and not any(key.startswith(n + ".") for key in split)]
    others = [n for n in others if not any(n.startswith(o + ".") for o in others)]
    if others:
        rank_zero_warn(
            f"tensor_parallel={tp} splits the blocks of '{prefix}'; those of {', '.join(repr(o) for o in others)}"
            " stay whole on every rank (exact, without the saving): the plan splits one stack of blocks. Name the"
            f" one to split with block_stack={others[0]!r}, or split another one's linears with tp_plan={{...}}"
            " (docs/model-convention.md) if it is large."
        )
