"""The region planners of the tensor-parallel planner. Each module of a block is offered to them in order; the
first that recognises it plans it:

1. latent attention (DeepSeek's MLA: a child named ``LATENT``), ``mla.py``;
2. a mixer of its own kind, found by ``MIXER_PLANNERS`` (state-space, linear attention);
3. a MoE layer (expert tensors among its children, or a list of expert MLPs), ``moe.py``;
4. attention or an MLP, found by its projections' roles (``families.py`` names, a shipped or user plan).

A family whose mixer is none of these adds one function ``(name, module, tp, sequence_parallel) -> MixerPlan |
None`` to ``MIXER_PLANNERS``. A planner returns whether the region is inline (its projections are the block's own
children) or ``None`` when it took the module but made no region of it; ``NOT_MINE`` passes it to the next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from lightning_llmpar.tensor_parallel import families as fam
from lightning_llmpar.tensor_parallel.entries import PlanEntry, TPPlan
from lightning_llmpar.tensor_parallel.entries import join as _join
from lightning_llmpar.tensor_parallel.entries import linear_like as _linear_like
from lightning_llmpar.tensor_parallel.entries import own_parameter_message as _own_message
from lightning_llmpar.tensor_parallel.lora import refuse_in_mixer
from lightning_llmpar.tensor_parallel.minimax_attention import plan_minimax_attention
from lightning_llmpar.tensor_parallel.mla import LATENT, plan_mla
from lightning_llmpar.tensor_parallel.moe import fused_experts, stacked_experts
from lightning_llmpar.tensor_parallel.ssm import MixerPlan, plan_ssm
from lightning_llmpar.tensor_parallel.styles import TOKEN, PrepareFirstInput, SplitLinear, is_conv1d

__all__ = ["MIXER_PLANNERS", "NOT_MINE", "RegionPlanning"]

MIXER_PLANNERS: tuple[Callable[[str, nn.Module, int, bool], MixerPlan | None], ...] = (plan_ssm, plan_minimax_attention)


class _NotMine:
    def __repr__(self) -> str:
        return "NOT_MINE"


NOT_MINE: Final = _NotMine()
Region = bool | None | _NotMine


class RegionPlanning:
    """Mixed into the planner: needs its ``tp``, ``seq``, ``styles``, ``claimed``, ``roles``, ``result`` and the
    attention / MoE planning methods."""

    tp: int
    seq: bool
    styles: dict[str, PlanEntry | None]
    claimed: set[str]
    roles: dict[str, str]
    result: TPPlan
    _attention: set[str]
    _moe_layers: set[str]
    _widths: dict[str, frozenset[int]]
    # from the planner and its other mixins
    _add: Callable[..., None]
    _role: Callable[..., str | None]
    _record_packing: Callable[..., None]
    _divisible: Callable[..., None]
    _plan_moe: Callable[..., None]
    _plan_expert_list: Callable[..., None]
    _is_expert_list: Callable[[nn.Module], bool]
    _plan_attention: Callable[..., Any]
    _column_packing: Callable[..., Any]
    _kv_style: Callable[..., Any]

    def _plan_region(self, full: str, module: nn.Module, covered: set[str], is_block: bool) -> bool | None:
        """Plan ``module`` if it forms a region; returns whether the region is inline, else None."""
        if self._role(full, "", module, {}) == "experts" or fused_experts(module, biases=True) or stacked_experts(module):
            return None  # planned with its MoE parent
        for planner in (self._plan_latent, self._plan_mixer, self._plan_moe_region, self._plan_projections):
            found = planner(full, module, covered, is_block)
            if found is not NOT_MINE:
                return found  # type: ignore[return-value]
        return None

    def _plan_latent(self, full: str, module: nn.Module, covered: set[str], is_block: bool) -> Region:
        """Multi-head latent attention (DeepSeek): split by heads with its shared latents whole (mla.py); one with
        parts beyond those (a sparse-attention indexer) is kept whole, as transformers' own plan keeps it."""
        if LATENT not in dict(module.named_children()) or full in self.claimed:
            return NOT_MINE
        split = [n for n, _ in module.named_modules() if _join(full, n) in self.claimed]
        if split:
            raise ValueError(
                f"tp_plan names '{_join(full, split[0])}' of {type(module).__name__} '{full}', a multi-head latent"
                " attention: its latents are shared by every head, so a split of its parts alone gives them a"
                f" partial gradient (wrong results). Leave '{full}' out of tp_plan: it is split by heads, with"
                " its shared latents whole."
            )
        mixer = plan_mla(full, module, self.tp, self.seq)
        if mixer is None:
            for n, _ in module.named_modules():
                self.claimed.add(_join(full, n))
                self.styles[_join(full, n)] = None
            return None
        return self._apply_mixer(full, module, mixer, covered)

    def _plan_mixer(self, full: str, module: nn.Module, covered: set[str], is_block: bool) -> Region:
        if full in self.claimed:
            return NOT_MINE

        def recognised() -> MixerPlan | None:
            return next((m for plan in MIXER_PLANNERS if (m := plan(full, module, self.tp, self.seq)) is not None), None)

        mixer = recognised()
        if mixer is None:
            refuse_in_mixer(full, module, recognised)  # adapters hid a mixer's projections: refused
            return NOT_MINE
        return self._apply_mixer(full, module, mixer, covered)

    def _apply_mixer(self, full: str, module: nn.Module, mixer: MixerPlan, covered: set[str]) -> bool:
        for name, style in mixer.styles.items():
            self._add(name, style, covered)
        self.result.packings.update(mixer.packings)
        self.result.local_counts.update(mixer.counts)
        covered.update(_join(full, n) for n, _ in module.named_modules())
        return False

    def _plan_moe_region(self, full: str, module: nn.Module, covered: set[str], is_block: bool) -> Region:
        children = dict(module.named_children())
        experts = [n for n, c in children.items()
                   if self.roles.get(_join(full, n)) == "experts" or fused_experts(c, biases=True) or stacked_experts(c)]
        if experts:  # called by the block itself (Gemma 4): under sequence parallelism no module holds the MoE path
            # alone to gather tokens for, so the router and the experts gather their flat tokens themselves (inline)
            self._plan_moe(full, module, experts, covered, flat=self.seq and is_block)
            return self.seq and is_block
        expert_list = next((n for n, c in children.items() if self._is_expert_list(c)), None)
        if expert_list is None:
            return NOT_MINE
        self._plan_expert_list(full, module, expert_list, covered)
        return False

    def _plan_projections(self, full: str, module: nn.Module, covered: set[str], is_block: bool) -> Region:
        """Attention (q/k/v then the output projection) or an MLP (up/gate then down), by its children's roles."""
        children = dict(module.named_children())
        # An expert, or an MLP beside the experts (a shared expert): the layer combines its output whole.
        in_moe = any(full.startswith(layer + ".") for layer in self._moe_layers)
        head_dim = getattr(module, "head_dim", None)
        name_roles = fam.name_roles({n: c for n, c in children.items() if _linear_like(c)},
                                    head_dim if isinstance(head_dim, int) else None)
        roles = {n: r for n, c in children.items() if (r := self._role(_join(full, n), n, c, name_roles))}
        cols = [n for n, r in roles.items() if r in ("col", "qkv", "gate_up")]
        rows = [n for n, r in roles.items() if r == "row"]
        if not cols or not rows:
            return None
        attention = any(roles[n] == "qkv" for n in cols) or any(n.lower() in fam.Q for n in cols) or hasattr(module, "head_dim")
        # An MLP whose projections are direct children of the block (OPT) is "inline": its input cannot be
        # gathered at a module boundary, so its column splits gather their own input.
        inline = not attention and is_block
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own and not inline and not attention and full not in self.claimed:  # (an inline block: see _plan_rest)
            raise ValueError(_own_message(module, full, own[0], "features"))
        heads = self._plan_attention(full, module, roles, cols) if attention else None
        if attention:
            self._attention.add(full)
        else:
            widths = [fam.out_features(children[n]) for n in cols] + [children[n].weight.shape[0 if is_conv1d(children[n]) else 1] for n in rows]
            self._widths[full] = frozenset(w // self.tp for w in widths)
        col_in = TOKEN if (self.seq and inline) else Replicate()
        row_out = TOKEN if self.seq and not in_moe else Replicate()  # an expert's output is combined whole
        for n in sorted(cols):
            name = _join(full, n)
            packing = self._column_packing(module, n, children[n], roles[n], heads)
            self._divisible(name, children[n], packing)
            shared = self._kv_style(full, n, roles[n], packing) if attention else None
            self._add(name, shared or SplitLinear("col", input=col_in, packing=packing), covered)
            if packing is not None:
                self._record_packing(name, children[n], packing)
        for n in sorted(rows):
            self._add(_join(full, n), SplitLinear("row", output=row_out), covered)
        for n in fam.HEADS_TO_HEADS.get(type(module).__name__, ()) if attention else ():
            self._add(_join(full, n), SplitLinear("row", output=Shard(-1)), covered)
        if not inline and not (self.seq and in_moe):  # a MoE layer under SP gathers its input itself
            self._add(full + "#in", PrepareFirstInput(TOKEN if self.seq else Replicate(), Replicate()), covered)
        if not inline:
            covered.add(full)
        return inline
