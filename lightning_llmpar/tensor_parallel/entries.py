"""What a tensor-parallel plan holds, the style names an explicit ``tp_plan`` may use, and shared helpers."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_llmpar.modeling.packing import Packing
from lightning_llmpar.tensor_parallel.lora import is_lora
from lightning_llmpar.tensor_parallel.param_styles import ReplicatedOnShards, ShardedNorm
from lightning_llmpar.tensor_parallel.styles import (
    TOKEN,
    PrepareFirstInput,
    SplitLinear,
    VocabEmbedding,
    is_conv1d,
)

__all__ = ["TPPlan", "TP_STYLES", "PlanEntry", "user_style"]

PlanEntry = ParallelStyle | None  # None: leave the module replicated


@dataclass
class TPPlan:
    """Styles per module (``name#tag`` when one module gets several), plus what the styles imply:
    ``packings`` (parameter name -> fused layout), ``local_counts`` (module -> head-count attributes to
    set per rank), and whether sequence parallelism stayed on."""

    styles: dict[str, PlanEntry] = field(default_factory=dict)
    packings: dict[str, Packing] = field(default_factory=dict)
    local_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    sequence_parallel: bool = False
    notes: list[str] = field(default_factory=list)
    # Modules whose activations differ per rank, up to their row-split projections: their dropout runs on a
    # per-rank random stream (see tensor_parallel.rng).
    rank_streams: dict[str, list[str]] = field(default_factory=dict)
    # Dropout modules inside such a part that see replicated activations (a LoRA adapter's on a column split's
    # input): the same mask on every rank.
    replicated_dropout: list[str] = field(default_factory=list)
    # The LM heads (a Linear onto the vocabulary outside the blocks) the plan split by vocabulary: loss parallelism
    # keeps their output split (see tensor_parallel.loss_parallel).
    vocab_heads: list[str] = field(default_factory=list)


def user_style(spec: Any, module: nn.Module, tp: int, name: str, pattern: str) -> tuple[PlanEntry, Packing | None]:
    """An explicit tp_plan value: a style name, or ``{"style": ..., "sizes": [...], "dim": d}`` for a fused
    projection whose pieces (in order, along ``dim``) each split over the ranks."""
    if isinstance(spec, Mapping):
        style = spec.get("style", "colwise")
        sizes = spec.get("sizes")
        if style not in ("colwise", "packed_colwise") or not sizes:
            raise ValueError(
                f"tp_plan entry for '{name}' = {dict(spec)!r}: a dict entry describes a fused projection, e.g."
                " {'style': 'colwise', 'sizes': [q_rows, k_rows, v_rows]} (add 'dim': 1 for a weight stored (in, out))."
            )
        dim = int(spec.get("dim", 1 if is_conv1d(module) else 0))
        packing = Packing(dim, tuple(int(s) for s in sizes), tp)
        if packing.total != module.weight.shape[dim]:
            raise ValueError(
                f"tp_plan['{name}'] sizes {list(sizes)} add up to {packing.total}, but the weight has"
                f" {module.weight.shape[dim]} along dim {dim}."
            )
        return SplitLinear("col", packing=packing), packing
    if spec not in TP_STYLES:
        raise ValueError(f"tp_plan[{pattern!r}] = {spec!r} is not a known style. Use one of {sorted(TP_STYLES)}.")
    return TP_STYLES[spec](), None


# Styles an explicit plan can name (Python or YAML); transformers' names are accepted too.
TP_STYLES: dict[str, Any] = {
    "colwise": lambda: SplitLinear("col"),
    "colwise_gather": lambda: SplitLinear("col", output=Replicate()),
    "colwise_gather_output": lambda: SplitLinear("col", output=Replicate()),
    "rowwise": lambda: SplitLinear("row"),
    "rowwise_split_input": lambda: SplitLinear("row", input=Replicate()),
    "rowwise_sequence": lambda: SplitLinear("row", output=TOKEN),
    "embedding": lambda: VocabEmbedding(input_layouts=Replicate(), output_layouts=Replicate()),
    "sequence_parallel": lambda: ReplicatedOnShards(2),
    "replicated_with_grad_allreduce": lambda: ReplicatedOnShards(2),
    "sharded_norm": lambda: ShardedNorm(),
    "prepare_sequence": lambda: PrepareFirstInput(TOKEN, Replicate()),
    "replicate": lambda: None,
}


def check_plan_entries(plan: Mapping[Any, Any]) -> None:
    """Refuse, before any process starts, a tp_plan whose keys are not name patterns or whose values name no style:
    a style is only read where its pattern matches a module, so a misspelt one would surface late or never."""
    for pattern, spec in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"tp_plan keys are module-name patterns such as 'model.layers.*.mlp.up_proj', got {pattern!r}.")
        if not isinstance(spec, Mapping) and (not isinstance(spec, str) or spec not in TP_STYLES):
            raise ValueError(
                f"tp_plan[{pattern!r}] = {spec!r} is not a known style. Use one of {sorted(TP_STYLES)}, or a dict"
                " {'style': 'colwise', 'sizes': [...]} for a fused projection."
            )


def check_plan_matches(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Refuse a tp_plan pattern that names no module of ``model`` (the whole model, before a pipeline split): the
    module it meant would be split by the inferred plan, or not at all, instead of as written."""
    names = [n for n, _ in model.named_modules() if n]
    for pattern in plan:
        if not any(fnmatchcase(n, pattern) for n in names):
            near = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
            hint = f" Nearest module names: {near}." if near else f" Its modules are named like {names[:3]}."
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__} (patterns are matched"
                f" with fnmatch against names from named_modules(), e.g. 'model.layers.*.mlp.up_proj').{hint}"
            )


class SequenceParallelUnfit(Exception):
    """This model cannot run with sequence-sharded activations inside its blocks; the plan is redone without."""


def join(prefix: str, name: str) -> str:
    if not name:
        return prefix
    return f"{prefix}.{name}" if prefix else name


def linear_like(module: nn.Module) -> bool:
    """A projection: nn.Linear, transformers' Conv1D, or a peft LoRA layer around one (split with it: lora.py)."""
    return isinstance(module, nn.Linear) or is_conv1d(module) or (is_lora(module) and linear_like(module.base_layer))


def is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and not any(True for _ in module.children())


def has_params(module: nn.Module, recurse: bool = False) -> bool:
    return any(True for _ in module.parameters(recurse=recurse))


def own_parameter_message(module: nn.Module, full: str, name: str, by: str) -> str:
    """Why a region holding a parameter of its own (beside its projections) cannot be split."""
    not_per_head = ", and it is not one value per query or key/value head"
    return (
        f"{type(module).__name__} '{full}' holds parameter '{name}' itself, beside the projections that tensor"
        f" parallelism splits by {by}{not_per_head if by == 'heads' else ''}, so no split of its own can be inferred."
        " Train this model with pipeline_parallel and/or data parallelism (zero_stage 0-3), or give the module a style"
        " in tp_plan."
    )
