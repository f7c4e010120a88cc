"""Infer a Megatron-style tensor-parallel plan for a model we did not write.

Inside each block, a *region* is a module whose children split by columns going in and by rows coming
out (attention: q/k/v then the output projection; MLP: up/gate then down; MoE: experts split along their
FFN width). Between a region's column and row splits each rank holds only its heads or features, so one
all-reduce per region (a reduce-scatter under sequence parallelism) restores the residual stream.
Roles come from an explicit ``tp_plan`` first, then from the plan the model ships (transformers'
``base_model_tp_plan``), then from projection names (``families``). Whatever holds parameters inside a
region and fits no role is refused with the module's name and the fix, because a whole parameter there would
get only this rank's part of its gradient; a Linear of no role on the whole hidden state is kept whole.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate

from lightning_llmpar.modeling.packing import Packing, on_rows
from lightning_llmpar.modeling.structure import find_block_stack, has_forward
from lightning_llmpar.tensor_parallel import families as fam
from lightning_llmpar.tensor_parallel.attention import AttentionPlanning
from lightning_llmpar.tensor_parallel.entries import TP_STYLES, PlanEntry, SequenceParallelUnfit, TPPlan, user_style
from lightning_llmpar.tensor_parallel.entries import has_params as _has_params
from lightning_llmpar.tensor_parallel.entries import is_norm as _is_norm
from lightning_llmpar.tensor_parallel.entries import join as _join
from lightning_llmpar.tensor_parallel.entries import linear_like as _linear_like
from lightning_llmpar.tensor_parallel.lora import is_lora
from lightning_llmpar.tensor_parallel.moe import MoEPlanning
from lightning_llmpar.tensor_parallel.outside import LORA_SPLITS, check_adapters, check_ties, plan_outside
from lightning_llmpar.tensor_parallel.param_styles import ReplicatedOnShards
from lightning_llmpar.tensor_parallel.regions import RegionPlanning
from lightning_llmpar.tensor_parallel.shipped import shipped_roles
from lightning_llmpar.tensor_parallel.styles import (
    TOKEN,
    GatherFirstOutput,
    PrepareFirstInput,
    SplitExperts,
    SplitLinear,
)

__all__ = ["TPPlan", "TP_STYLES", "infer_tp_plan", "PlanEntry"]  # TPPlan, TP_STYLES, PlanEntry: see entries

log = logging.getLogger(__name__)

def infer_tp_plan(
    model: nn.Module, tp: int, *, sequence_parallel: bool = True, user_plan: Mapping[str, Any] | None = None
) -> TPPlan:
    """Build the tensor-parallel plan for ``model``; raise a ValueError naming any module we cannot split."""
    if sequence_parallel:
        try:
            return _Planner(model, tp, True, user_plan or {}).plan()
        except SequenceParallelUnfit as why:
            note = f"sequence parallelism turned off for {type(model).__name__}: {why}"
            log.info(note)
            plan = _Planner(model, tp, False, user_plan or {}).plan()
            plan.notes.append(note)
            return plan
    return _Planner(model, tp, False, user_plan or {}).plan()


class _Planner(RegionPlanning, MoEPlanning, AttentionPlanning):
    def __init__(self, model: nn.Module, tp: int, seq: bool, user_plan: Mapping[str, Any]) -> None:
        self.model, self.tp, self.seq = model, tp, seq
        self.result = TPPlan(sequence_parallel=seq)
        self.styles = self.result.styles
        self.claimed: set[str] = set()
        self._moe_parents: set[str] = set()  # MoE layers whose experts are a list of MLP modules
        self._moe_layers: set[str] = set()  # every MoE layer: it works on whole (replicated) tokens
        self._attention: set[str] = set()  # attention regions (the others are MLPs)
        self._widths: dict[str, frozenset[int]] = {}  # MLP region -> this rank's widths of its split features
        self._shared_kv: dict[str, int] = {}  # attention region -> key/value heads, where fewer than the ranks
        self.roles = shipped_roles(model)
        for name, module in model.named_modules():
            for pattern, spec in user_plan.items():
                if name and fnmatchcase(name, pattern):
                    style, packing = user_style(spec, module, tp, name, pattern)
                    self.styles[name] = style
                    self.claimed.add(name)
                    if packing is not None:
                        self._record_packing(name, module, packing)
                    break
        self.user_plan = user_plan

    # ------------------------------------------------------------------ the whole model

    def plan(self) -> TPPlan:
        stack = find_block_stack(self.model)
        if stack is None and not self.user_plan:
            raise ValueError(
                f"Could not find a stack of transformer blocks (an nn.ModuleList, ModuleDict or Sequential of them)"
                f" in {type(self.model).__name__}. Name it with block_stack='...', or pass an explicit"
                f" `tp_plan` mapping module-name patterns to styles {sorted(TP_STYLES)}."
            )
        names = stack.names() if stack is not None else []
        if self.seq and stack is not None and not all(has_forward(b) for b in stack.modules()):
            raise SequenceParallelUnfit(
                f"the blocks of '{stack.prefix}' are containers without a forward, so the sequence cannot be split at"
                " their boundaries"
            )
        for block_name, block in zip(names, stack.modules() if stack is not None else []):
            self._plan_block(block_name, block)
        if stack is not None and self.seq and names:
            # The sequence is sharded only inside the stack: embeddings and the head see the full sequence,
            # so models that derive positions or masks from the embedding's shape keep working. Under
            # pipeline parallelism only the ranks holding the first / last block do this.
            # By key, not position: a ModuleDict's keys need not be "0".."N-1" (nor start at "0").
            keys = stack.keys()
            first, last = _join(stack.prefix, keys[0]), _join(stack.prefix, keys[-1])
            if first in names:
                self.styles.setdefault(first + "#in", PrepareFirstInput(Replicate(), TOKEN))
            if last in names:
                self.styles.setdefault(last + "#out", GatherFirstOutput(TOKEN, Replicate()))
        plan_outside(self.model, self.tp, self.styles, self.claimed, stack.prefix if stack is not None else None,
                     self.result.vocab_heads)
        check_ties(self.model, self.styles)
        check_adapters(self.model, self.styles, self.result.packings)
        return self.result

    # ------------------------------------------------------------------ one block

    def _role(self, name: str, leaf: str, module: nn.Module, roles_here: dict[str, str]) -> str | None:
        role = self.roles.get(name)
        if role == "col" and leaf.lower() in fam.FUSED_QKV | fam.FUSED_UP:
            role = None  # fused: our per-piece split, not the shipped gathered one
        if role in ("col", "row", "qkv", "gate_up") and not _linear_like(module) and not hasattr(module, "weight"):
            # A plan's projection name on a module wrapping one (an adapter written by hand): no weight to split.
            inner = next((f"'{name}.{n}'" for n, m in module.named_modules() if n and _linear_like(m)), "none")
            raise ValueError(
                f"Module '{name}' is a {type(module).__name__}, where the plan splits a projection: tensor parallelism"
                f" splits nn.Linear layers (and peft's LoRA layers around them), and this module has no weight of its"
                f" own (its linear layers: {inner}). Use peft's LoRA for adapters (split with their base layer), or"
                " train this model without tensor parallelism (zero_stage=3, pipeline_parallel)."
            )
        if role is not None or not _linear_like(module):
            return role
        return roles_here.get(leaf)

    def _plan_block(self, block_name: str, block: nn.Module) -> None:
        covered: set[str] = set()
        regions: dict[str, bool] = {}  # region module -> inline (its projections are children of a bigger module)
        for sub_name, sub in block.named_modules():
            full = _join(block_name, sub_name)
            kind = self._plan_region(full, sub, covered, sub is block)
            if kind is not None:
                regions[full] = kind
        self._plan_rest(block_name, block, covered, regions)
        self._plan_streams(block_name, block, regions)

    def _plan_streams(self, block_name: str, block: nn.Module, regions: dict[str, bool]) -> None:
        """Where dropout must draw per rank: inside attention/MLP regions (the experts, not the router, of a
        MoE layer), and under sequence parallelism the block's dropout modules outside them (token shards)."""
        streams = self.result.rank_streams
        for name, inline in regions.items():
            if inline or _join(name, "") in self._moe_parents:
                continue  # a layer of expert modules: its experts are regions of their own, its router shared
            experts = [n for n, s in self.styles.items() if n.startswith(name + ".") and isinstance(s, SplitExperts)]
            rows = [n for n, s in self.styles.items() if n.startswith(name + ".") and isinstance(s, SplitLinear)
                    and s.kind == "row" and n.count(".") == name.count(".") + 1]
            for expert in experts:
                streams[expert] = []
            if not experts:
                streams[name] = rows
            # A LoRA adapter's dropout: on a column split's or shared heads' (replicated) input alike on every rank,
            # else lora_A, whole on every rank, would step with different gradients; on a row split's (this rank's
            # features, after the part ends) per rank.
            for split, style in self.styles.items():
                if not (split.startswith(name + ".") and isinstance(style, LORA_SPLITS)):
                    continue
                if is_lora(lora := self.model.get_submodule(split)):
                    drops = [f"{split}.lora_dropout.{k}" for k, m in lora.lora_dropout.items() if isinstance(m, nn.Dropout)]
                    row = isinstance(style, SplitLinear) and style.kind == "row"
                    self.result.replicated_dropout.extend([] if row else drops)
                    streams.update({d: [] for d in drops if row})
        if self.seq:
            for sub_name, sub in block.named_modules():
                full = _join(block_name, sub_name)
                inside = any(full == r or full.startswith(r + ".") for r, inline in regions.items() if not inline)
                if isinstance(sub, nn.Dropout) and not inside:
                    streams[full] = []

    # ------------------------------------------------------------------ everything else in a block

    def _plan_rest(self, block_name: str, block: nn.Module, covered: set[str], regions: dict[str, bool]) -> None:
        def region_of(name: str) -> str | None:  # the innermost
            found = [r for r, inline in regions.items() if not inline and (name == r or name.startswith(r + "."))]
            return max(found, key=len, default=None)

        for sub_name, sub in block.named_modules():
            full = _join(block_name, sub_name)
            if full in covered or self.styles.get(full) is not None:
                continue
            if full not in self.claimed and region_of(full) in self._moe_layers:
                # In a MoE layer but in none of its experts or MLPs (a shared expert's gate): the layer takes whole
                # tokens and returns its output whole, so this module, left replicated, gets its full gradient.
                continue
            if _linear_like(sub) and full not in self.claimed:
                if region_of(full) is None and not any(regions.values()):
                    # On the whole hidden state, outside attention and MLP (Gemma 4's per-layer input gate): kept
                    # whole, as transformers' plans keep what they do not name. Every rank computes it alike and gets
                    # its full gradient; on token shards it would not, so sequence parallelism goes off.
                    if self.seq:
                        raise SequenceParallelUnfit(f"'{full}' is a Linear outside attention and MLP, kept whole")
                    continue
                raise ValueError(
                    f"Cannot decide how to split Linear '{full}' for tensor parallelism: it is neither a q/k/v/output"
                    f" projection next to its siblings nor an MLP projection inside '{region_of(full) or block_name}'."
                    f" Give it a style in tp_plan (e.g. tp_plan={{'{full}': 'colwise'}} or 'rowwise')."
                )
            if not _has_params(sub):
                continue
            region = region_of(full)
            # An embedding inside an MLP (Doge's CDMoE looks up expert vectors) reads whole indices, not this rank's
            # features: refused below.
            lookup = isinstance(sub, nn.Embedding) or self.roles.get(full) == "embedding"
            if region is not None and region not in self._attention | self._moe_layers and full not in self.claimed \
                    and not lookup:
                # Between an MLP's column and row splits (an activation with parameters, xIELU): applied to this
                # rank's features, the last dim; DTensor computes it and sums the whole parameters' gradient.
                self.styles[full] = ReplicatedOnShards(1, self._widths[region])
                continue
            if region is not None:
                # The styles split Linear layers: an embedding (T5's relative attention bias, a column per head)
                # takes none of them.
                fix = ("An embedding takes no splitting style (they split Linear layers): run this model without"
                       " tensor parallelism (ZeRO data parallelism takes it)." if lookup else
                       "Give it a splitting style in tp_plan ('colwise'/'rowwise'), or run this model without tensor"
                       " parallelism.")
                raise ValueError(
                    f"Module '{full}' holds parameters inside the tensor-parallel region '{region}', where each rank"
                    f" holds only some heads or features, so its gradient would miss the other ranks' part. {fix}"
                )
            if self.seq:
                if (_is_norm(sub) or self.roles.get(full) == "norm") and full not in self.claimed:
                    self.styles[full] = ReplicatedOnShards(2)
                else:
                    raise SequenceParallelUnfit(
                        f"'{full}' ({type(sub).__name__}) holds parameters outside attention and MLP and is not a norm,"
                        " so it would see only this rank's tokens"
                    )

    def _divisible(self, name: str, module: nn.Module, packing: Packing | None) -> None:
        width = fam.out_features(module)
        if packing is None and width % self.tp:
            raise ValueError(
                f"Projection '{name}' has {width} output features, not divisible by tensor_parallel({self.tp})."
                " Choose a degree that divides it."
            )

    def _add(self, name: str, style: PlanEntry, covered: set[str]) -> None:
        base = name.split("#", 1)[0]
        covered.add(base)
        if isinstance(style, LORA_SPLITS) and is_lora(module := self.model.get_submodule(base)):
            covered.update(_join(base, n) for n, _ in module.named_modules())  # its layers are split with it
        if name not in self.claimed:
            self.styles[name] = style

    def _record_packing(self, name: str, module: nn.Module, packing: Packing) -> None:
        self.result.packings[f"{name}.weight"] = packing
        if isinstance(getattr(module, "bias", None), nn.Parameter):
            self.result.packings[f"{name}.bias"] = on_rows(packing)

