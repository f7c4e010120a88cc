"""Tensor parallelism for recurrent and convolutional mixers: selective state-space (Mamba) mixers (Mamba,
FalconMamba, Jamba's Mamba layers: Mamba-1; Mamba-2 and its hybrids), gated delta-rule linear attention (Qwen3-Next,
Qwen3.5, OLMo-Hybrid; Kimi Linear's with low-rank gates) and gated short convolutions (LFM2).

A mixer's inner channels play the part of attention heads: each channel (Mamba-2: each head) has its own
convolution and its own scan, so a rank keeps its share of them in ``in_proj``, ``conv1d`` (depthwise),
``A_log``, ``D`` and the step-size parameters, and ``out_proj`` splits by rows like an attention's output.

- Mamba-1: ``x_proj`` reads every channel to make the per-token step size and B/C shared by all of them, so
  it splits by rows, its output is summed over the ranks going forward and, since each rank then uses it
  for its own channels only, its gradient is summed going back (Megatron's "g" followed by "f").
  Parameters applied to those shared values (Jamba's norms of dt, B and C) stay whole, gradient summed.
- Mamba-2: ``in_proj`` packs [gate, x, B, C, dt]; B and C belong to head groups, so with the groups split
  like the heads (Megatron's rule: groups divisible by the degree) each rank's heads read only its own
  groups and nothing crosses ranks before ``out_proj``. The gated norm normalizes within a group. With fewer
  groups than ranks (one group: Mamba2, Bamba, Granite-4, Falcon-H1 as released) each rank's heads lie in one
  group that several ranks share: B and C stay split in storage, and the mixer sees its group's, gathered
  (their gradients, partial per rank, reduce-scattered back); the gated norm's statistic spans ranks (DTensor).
- Gated delta rule: split by key heads, each with its value heads; nothing crosses ranks before ``out_proj``.
  The gated norm's weight, one value per feature of a head and shared by all heads, stays whole (gradient summed).
- Kimi delta attention: as the gated delta rule, by heads; its low-rank gates split their up projections and keep
  their down projections plain (the up projection sums its input's gradient, so theirs arrives complete).
- Short convolution: in_proj's [B; C; x] and the depthwise convolution split by channels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_llmpar.modeling.packing import Packing, to_packed
from lightning_llmpar.tensor_parallel.entries import join as _join
from lightning_llmpar.tensor_parallel.param_styles import ShardedNorm
from lightning_llmpar.tensor_parallel.styles import (
    TOKEN,
    PrepareFirstInput,
    SplitLinear,
    _distribute,
    _identity_forward_sum_backward,
    _local_params_in_forward,
)

__all__ = ["MixerParams", "MixerPlan", "SharedGroups", "divisible_heads", "linears", "plan_ssm", "region"]


@dataclass
class MixerPlan:
    """One mixer's styles (full names), the packed layouts of its parameters (full names, for checkpoints) and
    the widths its modules' code must see per rank (``counts``: module -> attribute -> value)."""

    styles: dict[str, ParallelStyle] = field(default_factory=dict)
    packings: dict[str, Packing] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class _Layout:
    cols: dict[str, Packing | None]  # the input projections (column split) -> their pieces, if packed
    split: dict[str, Packing | None]  # the mixer's own parameters split -> their pieces and dim (None: dim 0, whole)
    counts: dict[str, dict[str, int]]  # relative module name ("": the mixer) -> attribute -> value per rank
    groups: SharedGroups | None = None  # Mamba-2 head groups shared by several ranks
    # Down projections of low-rank gates: the column-split up projection after each sums its input's gradient over
    # the ranks, so theirs arrives complete: plain (summing it again would double it).
    plain: tuple[str, ...] = ()


def linears(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def _owned(module: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    holder = module.get_submodule(owner) if owner else module
    return isinstance(holder._parameters.get(leaf), nn.Parameter)


def plan_ssm(full: str, module: nn.Module, tp: int, seq: bool) -> MixerPlan | None:
    """The plan of ``module`` if it is a Mamba or gated-delta mixer (found by its parts' reference names), else None."""
    conv = next((c for n in ("conv1d", "conv") if isinstance(c := getattr(module, n, None), nn.Conv1d)), None)
    out = next((n for n in ("out_proj", "o_proj") if linears(module, n)), None)
    if conv is None or out is None:
        return None
    mamba1 = linears(module, "in_proj", "x_proj", "dt_proj")
    if isinstance(gate := getattr(module, "forget_gate", None), nn.Module) and _owned(gate, "A_log"):
        layout = _kimi_delta(full, module, tp, out)
    elif not _owned(module, "A_log"):
        if not linears(module, "in_proj") or module.in_proj.out_features != 3 * conv.in_channels:
            return None
        layout = _short_conv(full, module, tp)
    elif linears(module, "in_proj") and out == "out_proj":
        layout = _mamba1(full, module, tp) if mamba1 else _mamba2(full, module, tp)
    elif all(isinstance(getattr(module, a, None), int) for a in _GATED_DELTA_COUNTS):
        layout = _gated_delta(full, module, tp, out)
    else:
        return None
    if conv.groups != conv.in_channels:
        raise ValueError(f"'{full}' ({type(module).__name__}): its conv1d is not depthwise, so its channels cannot be split.")
    projections = (*layout.cols, "x_proj", out)
    whole = tuple(n for n, _ in module.named_parameters()
                  if n.rpartition(".")[0] not in (*projections, *layout.plain) and n not in layout.split)
    plan = region(full, module, layout.cols, out, seq)
    plan.counts.update({_join(full, n): c for n, c in layout.counts.items()})
    if mamba1:
        plan.styles[f"{full}.x_proj"] = SplitLinear("row", output=Replicate())
    # After x_proj's style: its hook then runs after the split's.
    buffers = _buffers(module, layout.cols.get("in_proj"))
    if layout.groups is not None and _owned(module, "norm.weight"):
        plan.styles[f"{full}.norm"] = ShardedNorm(gather=layout.groups.groups > 1)  # one group: a split statistic
        whole = tuple(n for n in whole if not n.startswith("norm."))
    plan.styles[f"{full}#params"] = MixerParams(layout.split, whole, buffers, out, layout.groups)
    plan.packings.update({_join(full, n): p for n, p in layout.split.items() if p is not None})
    return plan


def region(full: str, module: nn.Module, cols: dict[str, Packing | None], out: str, seq: bool) -> MixerPlan:
    """A mixer's region, as attention's: its input gathered from the sequence shards (or taken whole), its input
    projections ``cols`` split by columns (per piece where packed), its output projection ``out`` by rows."""
    plan = MixerPlan()
    plan.styles[f"{full}#in"] = PrepareFirstInput(TOKEN if seq else Replicate(), Replicate())
    for name, packing in cols.items():
        plan.styles[f"{full}.{name}"] = SplitLinear("col", packing=packing)
        for param in ("weight", "bias") if packing is not None else ():
            if _owned(module, f"{name}.{param}"):
                plan.packings[f"{full}.{name}.{param}"] = packing
    plan.styles[f"{full}.{out}"] = SplitLinear("row", output=TOKEN if seq else Replicate())
    return plan


def divisible_heads(full: str, module: nn.Module, heads: int, tp: int) -> None:
    if heads % tp:
        raise ValueError(
            f"Attention module '{full}' ({type(module).__name__}): {heads} heads not divisible by"
            f" tensor_parallel({tp}). Use a tensor_parallel degree that divides the head count."
        )


def _buffers(module: nn.Module, packing: Packing | None) -> dict[str, Packing]:
    """Buffers along in_proj's output (Falcon-H1's per-piece multipliers): the mixer's code sees them cut like it."""
    if packing is None:
        return {}
    return {n: Packing(b.dim() - 1, packing.sizes, packing.tp) for n, b in module.named_buffers(recurse=False)
            if b.dim() and b.shape[-1] == packing.total}


def _divisible(full: str, module: nn.Module, tp: int, **counts: int) -> None:
    bad = {k: v for k, v in counts.items() if v % tp}
    if bad:
        raise ValueError(
            f"Mixer '{full}' ({type(module).__name__}): {bad} not divisible by tensor_parallel({tp}); its channels"
            f" split with them ({counts}). Choose a degree that divides every count."
        )


def _short_conv(full: str, module: nn.Module, tp: int) -> _Layout:
    """A gated short convolution (LFM2): in_proj makes [B; C; x] per channel, each channel convolved on its own."""
    width = module.conv.in_channels
    _divisible(full, module, tp, channels=width)
    return _Layout({"in_proj": Packing(0, (width, width, width), tp)},
                   {n: None for n in ("conv.weight", "conv.bias") if _owned(module, n)}, {})


def _mamba1(full: str, module: nn.Module, tp: int) -> _Layout:
    width = module.x_proj.in_features
    _divisible(full, module, tp, inner_channels=width)
    names = ("A_log", "D", "conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias")
    return _Layout({"in_proj": Packing(0, (width, width), tp)}, {n: None for n in names if _owned(module, n)},
                   {"": {"intermediate_size": width // tp}})


def _mamba2(full: str, module: nn.Module, tp: int) -> _Layout:
    heads, groups, state = (getattr(module, a, None) for a in ("num_heads", "n_groups", "ssm_state_size"))
    width = module.out_proj.in_features
    if not all(isinstance(v, int) for v in (heads, groups, state)):
        raise ValueError(
            f"'{full}' ({type(module).__name__}) is a state-space mixer of a layout tensor parallelism does not know"
            " (Mamba-1: x_proj and dt_proj; Mamba-2: num_heads, n_groups and ssm_state_size). Train it"
            " with pipeline_parallel and/or zero_stage, which take it as it is, or without tensor parallelism."
        )
    _divisible(full, module, tp, heads=heads)
    shared = groups % tp != 0
    if shared and tp % groups:
        raise ValueError(
            f"Mixer '{full}' ({type(module).__name__}): {groups} head groups and tensor_parallel({tp}): each rank's"
            " heads must lie in one group (the degree a multiple of the group count) or own whole groups (the group"
            " count a multiple of the degree). Choose a degree that is one of these."
        )
    grouped = groups * state
    conv = Packing(0, (width, grouped, grouped), tp)  # [x; B; C]
    in_proj = Packing(0, (width, width, grouped, grouped, heads), tp)  # [gate; x; B; C; dt]
    split: dict[str, Packing | None] = {"conv1d.weight": conv, "conv1d.bias": conv}
    split |= {n: None for n in ("A_log", "D", "dt_bias")}  # one value per head
    split = {n: p for n, p in split.items() if _owned(module, n)}
    local = groups // tp if not shared else 1  # groups the mixer's code sees
    counts = {"": {"num_heads": heads // tp, "n_groups": local, "intermediate_size": width // tp,
                   "conv_dim": width // tp + 2 * local * state}}
    norm = getattr(module, "norm", None)
    if shared:  # the norm's group spans ranks: it sees the whole width as DTensors, with its whole counts
        return _Layout({"in_proj": in_proj}, split, counts, SharedGroups(groups, state, in_proj))
    if isinstance(getattr(norm, "n_groups", None), int):
        counts["norm"] = {"n_groups": groups // tp}  # a gated norm that reads its own group count (Falcon-H1)
    split |= {"norm.weight": None} if _owned(module, "norm.weight") else {}
    return _Layout({"in_proj": in_proj}, split, counts)


@dataclass(frozen=True)
class SharedGroups:
    """Mamba-2 head groups fewer than the ranks: rank r's heads lie in group r // (tp // groups). B and C (``state``
    features per group) are stored split like every piece of ``in_proj`` and ``conv1d``; the mixer's code sees its
    group's, gathered from the ranks, whose gradients (partial: this rank's heads only) are reduce-scattered back."""

    groups: int
    state: int
    in_proj: Packing  # [gate; x; B; C; dt]

    def _group(self, rank: int) -> int:
        return rank // (self.in_proj.tp // self.groups)

    def regroup(self, local: Tensor, packing: Packing, mesh: DeviceMesh, dim: int | None = None) -> Tensor:
        """This rank's slices of ``packing``'s pieces along ``dim`` (default: the packing's) -> the same with B and C
        its group's."""
        dim = (packing.dim if dim is None else dim) % local.dim()
        parts = list(local.split([size // packing.tp for size in packing.sizes], dim))
        at = 2 if len(parts) == 5 else 1  # B, then C: [gate; x; B; C; dt] or [x; B; C]
        for i in (at, at + 1):
            whole = DTensor.from_local(parts[i], mesh, (Shard(dim),), run_check=False)
            whole = whole.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),))
            parts[i] = whole.narrow(dim, self._group(mesh.get_local_rank()) * self.state, self.state)
        return torch.cat(parts, dim)

    def cut(self, whole: Tensor, packing: Packing, rank: int) -> Tensor:
        """This rank's part of a whole tensor laid out like ``packing`` (a buffer), B and C its group's."""
        parts = list(whole.split(packing.sizes, packing.dim))
        at = 2 if len(parts) == 5 else 1
        for i, part in enumerate(parts):
            shared = i in (at, at + 1)
            start = self._group(rank) * self.state if shared else rank * part.shape[packing.dim] // packing.tp
            parts[i] = part.narrow(packing.dim, start, self.state if shared else part.shape[packing.dim] // packing.tp)
        return torch.cat(parts, packing.dim)


_GATED_DELTA_COUNTS = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
# Input projections of gated delta-rule mixers by name, all split by heads: Qwen3-Next's rows grouped per key head
# ([q, k, v, z] and [b, a] of each), Qwen3.5's in_proj_qkv [all q; all k; all v] (packed below), one per value
# head or per value feature otherwise; OLMo-Hybrid's separate q/k/v/a/b/g projections.
_GATED_DELTA_INPUTS = {"in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "q_proj",
                       "k_proj", "v_proj", "a_proj", "b_proj", "g_proj"}


def _gated_delta(full: str, module: nn.Module, tp: int, out: str) -> _Layout:
    """Gated delta-rule linear attention (Qwen3-Next, Qwen3.5, OLMo-Hybrid): split by key heads, each with its value
    heads."""
    counts = {a: getattr(module, a) for a in _GATED_DELTA_COUNTS}
    linears = [n for n, c in module.named_children() if isinstance(c, nn.Linear) and n != out]
    unknown = [n for n in linears if n not in _GATED_DELTA_INPUTS]
    if unknown:  # a low-rank gate (Kimi's g_a_proj -> g_b_proj) is not split by heads
        raise ValueError(
            f"'{full}' ({type(module).__name__}) is a gated delta-rule mixer with projection '{unknown[0]}' that tensor"
            " parallelism cannot split by heads. Train this model with pipeline_parallel and/or zero_stage, which take"
            " it as it is, or without tensor parallelism."
        )
    k_heads, v_heads = counts["num_k_heads"], counts["num_v_heads"]
    _divisible(full, module, tp, key_heads=k_heads, value_heads=v_heads)
    key, value = k_heads * counts["head_k_dim"], v_heads * counts["head_v_dim"]
    qkv = Packing(0, (key, key, value), tp)
    cols: dict[str, Packing | None] = {n: qkv if n == "in_proj_qkv" else None for n in linears}
    split: dict[str, Packing | None] = {"conv1d.weight": qkv, "conv1d.bias": qkv, "A_log": None, "dt_bias": None}
    local = {"num_k_heads": k_heads // tp, "num_v_heads": v_heads // tp, "key_dim": key // tp, "value_dim": value // tp,
             "conv_dim": (2 * key + value) // tp}
    # The gated norm's weight is per head dim, shared by every head: whole, gradient summed (MixerParams).
    return _Layout(cols, {n: p for n, p in split.items() if _owned(module, n)}, {"": local})


_KIMI_COLS = ("q_proj", "k_proj", "v_proj", "b_proj", "g_b_proj", "forget_gate.f_b_proj")
_KIMI_PLAIN = ("g_a_proj", "forget_gate.f_a_proj")


def _kimi_delta(full: str, module: nn.Module, tp: int, out: str) -> _Layout:
    """Kimi delta attention (Kimi Linear): the gated delta rule with a per-channel decay, split by heads: q/k/v, the
    beta projection and the up projections of its two low-rank gates (decay: ``forget_gate``; output: ``g_b_proj``);
    their down projections stay plain."""
    heads, dim = getattr(module, "num_heads", None), getattr(module, "head_dim", None)
    linears = {n for n, c in module.named_modules() if isinstance(c, nn.Linear)} - {out}
    if not isinstance(heads, int) or not isinstance(dim, int) or linears != {*_KIMI_COLS, *_KIMI_PLAIN}:
        raise ValueError(
            f"'{full}' ({type(module).__name__}) is a delta-rule mixer with a forget gate whose projections"
            f" ({sorted(linears)}) tensor parallelism does not know how to split by heads. Train this model with"
            " pipeline_parallel and/or zero_stage, which take it as it is, or without tensor parallelism."
        )
    _divisible(full, module, tp, heads=heads)
    width = heads * dim
    qkv = Packing(0, (width, width, width), tp)
    split: dict[str, Packing | None] = {"conv1d.weight": qkv, "conv1d.bias": qkv, "forget_gate.dt_bias": None,
                                        "forget_gate.A_log": Packing(2, (heads,), tp)}  # A_log: (1, 1, heads, 1)
    local = {"num_heads": heads // tp, "qkv_dim": width // tp}
    return _Layout({n: None for n in _KIMI_COLS}, {n: p for n, p in split.items() if _owned(module, n)},
                   {"": {**local, "conv_dim": 3 * width // tp}, "forget_gate": local}, plain=_KIMI_PLAIN)


class MixerParams(ParallelStyle):
    """A mixer's own parameters: ``split`` (name -> packing of its pieces along its dim, or None: dim 0), ``whole``
    applied to values every rank shares (gradient summed). The mixer's code runs on their local tensors. ``x_proj``'s
    output, when it has one, is shared by every rank's channels: its gradient is summed. With ``groups`` (Mamba-2
    head groups shared by several ranks) the mixer sees its group's B and C in in_proj's output and conv1d."""

    def __init__(
        self,
        split: dict[str, Packing | None],
        whole: tuple[str, ...],
        buffers: dict[str, Packing],
        out: str,
        groups: SharedGroups | None = None,
    ) -> None:
        super().__init__()
        self.split, self.whole, self.buffers, self.out, self.groups = split, whole, buffers, out, groups

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in (*self.split, *self.whole):
            owner, _, leaf = name.rpartition(".")
            holder = module.get_submodule(owner) if owner else module
            packing = self.split.get(name)
            placement = Shard(packing.dim if packing is not None else 0) if name in self.split else Replicate()
            holder.register_parameter(leaf, _distribute(holder._parameters[leaf], device_mesh, placement, packing))
        rank, groups = device_mesh.get_local_rank(), self.groups

        def local(name: str, tensor: Any) -> Any:
            if name in self.buffers:  # whole in the module (initialized, saved and loaded whole); its code sees its cut
                packing = self.buffers[name]
                if groups is not None:
                    return groups.cut(tensor, packing, rank)
                return to_packed(tensor, packing).chunk(packing.tp, packing.dim)[rank]
            out = tensor.to_local(grad_placements=(Partial(),) if name in self.whole else None)
            packing = self.split.get(name)
            return groups.regroup(out, packing, device_mesh) if groups is not None and packing is not None else out

        _local_params_in_forward(module, [*self.split, *self.whole, *self.buffers], local)
        calls: list[bool] = []

        def check(mod: nn.Module, args: tuple, output: Any) -> None:
            if not calls:
                # A fused kernel (mamba_ssm's) computed the mixer without its output projection: the split's reductions
                # never ran, so its output would be wrong.
                raise RuntimeError(
                    f"{type(mod).__name__} ran a fused kernel that bypasses tensor parallelism's split of its"
                    " projections. Uninstall mamba_ssm (the PyTorch path is split exactly), or train this model"
                    " without tensor parallelism."
                )
            calls.clear()

        module.get_submodule(self.out).register_forward_hook(lambda *_: calls.append(True))
        if groups is not None:
            regroup = groups.regroup
            module.in_proj.register_forward_hook(lambda _m, _a, out: regroup(out, groups.in_proj, device_mesh, -1))
        if isinstance(getattr(module, "x_proj", None), nn.Module):
            module.x_proj.register_forward_hook(lambda _m, _a, out: _identity_forward_sum_backward(out, device_mesh))
        module.register_forward_hook(check)
        return module
