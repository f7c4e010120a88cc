"""The attention part of the tensor-parallel planner: head counts, fused q/k/v layouts, an attention's own
parameters and q/k norms, and the per-rank head counts its code reshapes with."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_llmpar.modeling.packing import Packing
from lightning_llmpar.modeling.structure import count_attr
from lightning_llmpar.tensor_parallel import families as fam
from lightning_llmpar.tensor_parallel.entries import PlanEntry, TPPlan
from lightning_llmpar.tensor_parallel.entries import has_params as _has_params
from lightning_llmpar.tensor_parallel.entries import is_norm as _is_norm
from lightning_llmpar.tensor_parallel.entries import join as _join
from lightning_llmpar.tensor_parallel.entries import own_parameter_message as _own_message
from lightning_llmpar.tensor_parallel.param_styles import OwnPerHead, OwnShared, ReplicatedOnShards, ShardedNorm
from lightning_llmpar.tensor_parallel.shared_heads import SharedKVHeads, shared_kv_heads
from lightning_llmpar.tensor_parallel.styles import HeadSlice, is_conv1d

__all__ = ["AttentionPlanning"]


class AttentionPlanning:
    """The attention part of the planner (mixed into it): needs ``tp``, ``styles``, ``claimed``, ``roles`` and
    ``result`` from it."""

    tp: int
    seq: bool
    styles: dict[str, PlanEntry | None]
    claimed: set[str]
    roles: dict[str, str]
    result: TPPlan
    _shared_kv: dict[str, int]  # attention region -> its key/value heads, where fewer than the ranks

    def _column_packing(self, region: nn.Module, leaf: str, child: nn.Module, role: str, layout: Any) -> Packing | None:
        """How a column-split projection of a region is cut: per fused piece, per half, or plainly (None)."""
        if role == "qkv":
            return layout.packing if layout is not None else None
        # [gate; up] halves, or the two halves of heads a differential attention pairs (head h with h + heads/2).
        paired = type(region).__name__ in fam.PAIRED_HALVES and leaf.lower() in fam.Q | fam.K | fam.V
        if role != "gate_up" and not paired:
            return None
        width = fam.out_features(child)
        return Packing(1 if is_conv1d(child) else 0, (width // 2, width // 2), self.tp)

    def _plan_attention(self, full: str, attn: nn.Module, roles: dict[str, str], cols: list[str]) -> Any:
        whole = {n: self.styles.get(_join(full, n), False) is None for n, r in roles.items() if r in ("col", "qkv", "row")}
        if len(set(whole.values())) > 1:  # the heads whole on one side of the attention, split on the other
            kept, split = sorted(n for n, w in whole.items() if w), sorted(n for n, w in whole.items() if not w)
            raise ValueError(
                f"tp_plan keeps {[_join(full, n) for n in kept]} whole ('replicate') but the plan splits"
                f" {[_join(full, n) for n in split]} by heads: the attention's heads cannot be whole on one side and"
                f" split on the other (its first step would fail in a matmul). Give the same style to all of"
                f" {sorted(whole)}: 'replicate' to keep the attention whole, or none to split it."
            )
        if all(whole.values()):
            return None  # the user's plan keeps q/k/v whole ('replicate'): every rank holds every head, as its counts say
        fused = [n for n in cols if roles[n] == "qkv"]
        layout = None
        if fused and _join(full, fused[0]) not in self.claimed:
            layout = fam.fused_qkv_layout(attn, self.tp)
            if layout is None:
                name = _join(full, fused[0])
                raise ValueError(
                    f"Module '{name}' fuses q, k and v in one projection of {type(attn).__name__}, whose row layout"
                    f" is not known. Describe it: with rows [all q; all k; all v] use tp_plan={{'{name}': {{'style':"
                    f" 'colwise', 'sizes': [q_rows, k_rows, v_rows]}}}}; with rows grouped per head (GPT-NeoX,"
                    f" Megatron) tp_plan={{'{name}': 'colwise'}}."
                )
        counts = {a: v for a in fam.HEAD_COUNT_ATTRS if isinstance(v := getattr(attn, a, None), int) and not isinstance(v, bool)}
        if layout is not None:
            counts.setdefault("query heads", layout.heads)
            counts.setdefault("key/value heads", layout.kv_heads)
        head_dim = getattr(attn, "head_dim", None) or getattr(getattr(attn, "config", None), "head_size", None)
        if layout is not None and layout.packing is not None:
            head_dim = layout.packing.sizes[0] // layout.heads
        if isinstance(head_dim, int) and head_dim > 0 and not fused:
            q = next((n for n in cols if n.lower() in fam.Q), None)
            k = next((n for n in cols if n.lower() in fam.K), None)
            if q is not None:
                counts.setdefault("query heads", fam.out_features(attn.get_submodule(q)) // head_dim)
            if k is not None:
                counts.setdefault("key/value heads", fam.out_features(attn.get_submodule(k)) // head_dim)
        if type(attn).__name__ in fam.PAIRED_HALVES:  # each half is split, so each rank holds whole pairs
            counts.update({f"{what} per half": value // 2 for what, value in list(counts.items()) if "heads" in what})
        kv = next((v for what, v in counts.items() if what in fam.KV_COUNT_ATTRS or what == "key/value heads"), None)
        shared = kv is not None and shared_kv_heads(kv, self.tp)
        for what, value in counts.items():
            if value % self.tp and not (shared and value == kv and (what in fam.KV_COUNT_ATTRS or "key/value" in what)):
                raise ValueError(
                    f"Attention module '{full}': {what} = {value} is not divisible by tensor_parallel({self.tp})."
                    f" Use a tensor_parallel degree that divides every head count ({counts}), or, for key/value"
                    " heads, a multiple of them (each then shared by several ranks)."
                )
        if shared:
            self._shared_kv[full] = kv
            self._refuse_shared(full, attn, kv, head_dim)
        own = {n: p for n, p in attn.named_parameters(recurse=False)}
        returned = tuple(n for n in fam.RETURNED_BIAS.get(type(attn).__name__, ()) if n in own)
        if returned and full not in self.claimed:
            # Added by the block after the row split's reduction: whole tokens alike on every rank, or under sequence
            # parallelism this rank's tokens, whose gradients sum to the whole.
            self.styles[full + "#returned"] = OwnShared(returned, summed=self.seq)
            own = {n: p for n, p in own.items() if n not in returned}
        if own and full not in self.claimed and type(attn).__name__ in fam.PAIRED_HALVES:
            self.styles[full + "#own"] = OwnShared(tuple(own))  # the λ vectors every head pair uses
        elif own and full not in self.claimed:
            heads = {counts.get("query heads"), counts.get("key/value heads")} - {None}
            bad = next((n for n, p in own.items() if p.dim() == 0 or p.shape[0] not in heads), None)
            if bad is not None:
                raise ValueError(_own_message(attn, full, bad, "heads"))
            # One value per query head (GPT-OSS's sinks) or key/value head (Doge's A) held by the attention itself:
            # this rank's heads, split as its projections split them.
            self.styles[full + "#own"] = OwnPerHead(tuple(own))
        self._local_counts(full, attn, cols, layout)
        slices = fam.head_slices(attn)
        if slices:
            self.styles[full + "#heads"] = HeadSlice(slices)
        self._plan_qk_norms(full, attn, head_dim)
        return layout

    def _kv_style(self, region: str, leaf: str, role: str, packing: Packing | None) -> Any:
        """The style of a column split whose key/value heads are shared by several ranks, or None."""
        kv = self._shared_kv.get(region)
        if kv is None or (role != "qkv" and leaf.lower() not in fam.K | fam.V):
            return None
        name = _join(region, leaf)
        if role == "qkv" and packing is None:
            raise ValueError(
                f"Module '{name}' fuses q, k and v grouped per head or per key/value group, and its {kv} key/value"
                f" head(s) are fewer than tensor_parallel({self.tp}), so a rank's rows would not hold whole groups:"
                f" {_fewer(kv)}."
            )
        if role == "qkv":
            return SharedKVHeads(kv, packing, (False, True, True))
        return SharedKVHeads(kv)

    def _refuse_shared(self, full: str, attn: nn.Module, kv: int, head_dim: Any) -> None:
        """What cannot follow key/value heads shared by several ranks."""
        why = None
        if type(attn).__name__ in fam.PAIRED_HALVES | set(fam.HEADS_TO_HEADS):
            why = f"{type(attn).__name__} pairs or mixes its key/value heads"
        own = [n for n, p in attn.named_parameters(recurse=False) if p.dim() and p.shape[0] == kv]
        if own:
            why = f"its parameter '{own[0]}' holds one value per key/value head"
        norms = [n for n, c in attn.named_children() if _is_norm(c) and _has_params(c)
                 and isinstance(head_dim, int) and next(c.parameters()).shape[0] == kv * head_dim != head_dim]
        if norms:
            why = f"its norm '{norms[0]}' spans all key/value heads' features"
        if why is not None:
            raise ValueError(
                f"Attention module '{full}' has {kv} key/value head(s), fewer than tensor_parallel({self.tp}), so each"
                f" is shared by several ranks; but {why}, which cannot be shared so: {_fewer(kv)}."
            )

    def _local_counts(self, full: str, attn: nn.Module, cols: list[str], layout: Any) -> None:
        q_width = sum(fam.out_features(attn.get_submodule(n)) for n in cols if n.lower() in fam.Q)
        if layout is not None and layout.packing is not None:
            q_width = layout.packing.sizes[0]
        elif layout is not None and isinstance(getattr(attn, "head_dim", None), int):
            q_width = layout.heads * attn.head_dim
        shared = full in self._shared_kv

        def local(attr: str, value: int) -> int:  # one key/value head per rank where the ranks share them
            return 1 if shared and attr in fam.KV_COUNT_ATTRS else value // self.tp

        patch = {a: local(a, v) for a in fam.HEAD_COUNT_ATTRS if isinstance(v := getattr(attn, a, None), int) and not isinstance(v, bool)}
        groups = getattr(attn, "num_key_value_groups", None)
        if shared and isinstance(groups, int) and q_width and isinstance(getattr(attn, "head_dim", None), int):
            patch["num_key_value_groups"] = q_width // attn.head_dim // self.tp  # this rank's query heads, one kv head
        for attr in fam.WIDTH_ATTRS:
            value = getattr(attn, attr, None)
            if isinstance(value, int) and q_width and value == q_width:
                patch[attr] = value // self.tp
        patch.update(layout.patch if layout is not None else ())
        config = getattr(attn, "config", None)
        if config is not None:
            # Some attention code splits with the (shared) config's head counts (Phi-3, LitGPT): give it its
            # own copy with this rank's counts.
            for attr in fam.HEAD_COUNT_ATTRS:
                if (value := count_attr(config, attr)) is not None:
                    patch[f"config.{attr}"] = local(attr, value)
        if patch:
            self.result.local_counts[full] = patch

    def _plan_qk_norms(self, full: str, attn: nn.Module, head_dim: Any) -> None:
        for n, child in attn.named_children():
            name = _join(full, n)
            if name in self.claimed or not _is_norm(child) or not _has_params(child):
                continue
            size = next(child.parameters()).shape[0]
            if self.roles.get(name) == "headwise" or (isinstance(head_dim, int) and size == head_dim):
                self.styles[name] = ReplicatedOnShards(2)  # per head: this rank's heads, gradient summed
            else:
                self.styles[name] = ShardedNorm()  # over all heads' features: split with them


def _fewer(kv: int) -> str:
    """The fix where key/value heads cannot be shared between ranks."""
    if kv == 1:
        return "train this model without tensor parallelism (tensor_parallel=1)"
    return f"use a tensor_parallel degree that divides its {kv} key/value heads"
