"""Tensor-parallel plans for mixture-of-experts layers: fused 3-D expert weights (transformers) and lists of
expert MLPs (LitGPT, Megatron-style), split along each expert's FFN width; routers stay whole."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate

from lightning_llmpar.modeling.packing import Packing
from lightning_llmpar.tensor_parallel import families as fam
from lightning_llmpar.tensor_parallel.entries import PlanEntry, TPPlan
from lightning_llmpar.tensor_parallel.entries import join as _join
from lightning_llmpar.tensor_parallel.entries import linear_like as _linear_like
from lightning_llmpar.tensor_parallel.styles import TOKEN, GatherFirstOutput, PrepareFirstInput, SplitExperts

__all__ = ["MoEPlanning", "fused_experts", "stacked_experts"]


class MoEPlanning:
    """The MoE part of the planner (mixed into it): needs ``tp``, ``seq``, ``result`` and ``_add`` from it."""

    tp: int
    seq: bool
    result: TPPlan
    _moe_parents: set[str]
    _moe_layers: set[str]

    def _add(self, name: str, style: PlanEntry, covered: set[str]) -> None:
        raise NotImplementedError

    def _is_expert_list(self, module: nn.Module) -> bool:
        """A ModuleList of identical MLP modules (LitGPT's LLaMAMoE experts, Megatron-style expert lists)."""
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or len({type(m) for m in module}) != 1:
            return False
        linears = {n: c for n, c in module[0].named_children() if _linear_like(c)}
        roles = set(fam.name_roles(linears).values())
        return bool(roles & {"col", "gate_up"}) and "row" in roles

    def _plan_expert_list(self, full: str, moe: nn.Module, expert_list: str, covered: set[str]) -> None:
        """A MoE layer whose experts are MLP modules: each expert is split like an MLP (its output all-reduced,
        since the layer combines it with routing weights); the layer takes the full sequence; routers stay whole
        (the experts' outputs are complete, so is their gradient)."""
        experts = moe.get_submodule(expert_list)
        self._moe_parents.add(full)
        self._moe_layers.add(full)
        for n, child in moe.named_children():
            params = list(child.parameters())
            if n != expert_list and len(params) == 1 and params[0].dim() == 2 and params[0].shape[0] == len(experts):
                covered.add(_join(full, n))
        if self.seq:
            self._add(full + "#in", PrepareFirstInput(TOKEN, Replicate()), covered)
            self._add(full + "#out", GatherFirstOutput(Replicate(), TOKEN), covered)
        covered.update([full, _join(full, expert_list)])

    def _plan_moe(self, full: str, moe: nn.Module, experts: list[str], covered: set[str], flat: bool = False) -> None:
        """``flat``: the experts and their router are called by a block under sequence parallelism (Gemma 4), on
        this rank's tokens flattened: each gathers all tokens (the same order on both), the experts' output is
        scattered back; the block stays a plain block (its norms on token shards)."""
        if not flat:
            self._moe_layers.add(full)
        num_experts = {p.shape[0] for n in experts for p in moe.get_submodule(n).parameters(recurse=False)}
        num_experts |= {getattr(m, fam.STACKED_EXPERTS[type(m).__name__][3]) for n in experts
                        if stacked_experts(m := moe.get_submodule(n))}
        hidden = None
        for n, child in moe.named_children():
            params = [p for p in child.parameters() if p.dim() == 2]
            if n not in experts and len(params) == 1 and params[0].shape[0] in num_experts:
                # The router stays whole: the experts' inputs (tokens, routing weights) sum their gradients over
                # ranks, so it receives the full gradient.
                covered.add(_join(full, n))
                hidden = params[0].shape[1]
                if flat:  # whole, on all tokens: every rank computes (and differentiates) it alike
                    covered.update(_join(_join(full, n), s) for s, _ in child.named_modules())
                    self._add(_join(full, n) + "#in", PrepareFirstInput(TOKEN, Replicate()), covered)
        for n in experts:
            name = _join(full, n)
            module = moe.get_submodule(n)
            params = self._stacked_params(name, module) if stacked_experts(module) else self._fused_params(name, module, hidden)
            # Hooks run in the order the styles are applied: all tokens gathered before the experts' input sums its
            # gradient over ranks, and their output summed before it is scattered (else each rank would combine
            # its own chunk of another rank's partial sums).
            if flat:
                self._add(name + "#in", PrepareFirstInput(TOKEN, Replicate()), covered)
            self._add(name, SplitExperts(params), covered)
            if flat:
                self._add(name + "#out", GatherFirstOutput(Replicate(), TOKEN), covered)
        if flat:
            return
        if self.seq:
            self._add(full + "#in", PrepareFirstInput(TOKEN, Replicate()), covered)
            self._add(full + "#out", GatherFirstOutput(Replicate(), TOKEN), covered)
        covered.add(full)

    def _fused_params(self, name: str, module: nn.Module, hidden: int | None) -> dict:
        """3-D expert weights (and (E, out) biases): each one's split dim and packing."""
        weights = dict(module.named_parameters(recurse=False))
        down = next((p for pname, p in weights.items() if ("down" in pname or pname == "w2") and p.dim() == 3), None)
        # Some experts store (E, in, out) (Llama 4, GPT-OSS; transformers marks them is_transposed): the FFN
        # width is then dim 1 of down_proj (E, I, H), dim 2 of gate_up_proj (E, H, 2I). Else told apart by
        # the router's hidden size. Interleaved gate/up columns (is_concatenated=False) split as they are.
        transposed = getattr(module, "is_transposed", down is not None and down.shape[2] == hidden != down.shape[1])
        concatenated = getattr(module, "is_concatenated", type(module).__name__ not in fam.INTERLEAVED_EXPERTS)
        params = {}
        for pname, p in weights.items():
            is_down = "down" in pname or pname == "w2"
            if p.dim() == 2 and pname.endswith("bias"):  # (E, out): split with its weight's outputs
                params[pname] = (None, None) if is_down else (1, None)
                if not is_down and concatenated:
                    params[pname] = (1, Packing(1, (p.shape[1] // 2,) * 2, self.tp))
                    self.result.packings[_join(name, pname)] = params[pname][1]
                continue
            if p.dim() != 3:
                raise ValueError(f"MoE experts '{name}': parameter '{pname}' is not a 3-D (experts, out, in) weight.")
            if is_down:
                params[pname] = (1 if transposed else 2, None)
            else:
                dim = 2 if transposed else 1
                gate_up = ("gate_up" in pname or pname == "w13") and concatenated
                packing = Packing(dim, (p.shape[dim] // 2,) * 2, self.tp) if gate_up else None
                params[pname] = (dim, packing)
                if packing is not None:
                    self.result.packings[_join(name, pname)] = packing
            if p.shape[params[pname][0]] % self.tp:
                raise ValueError(
                    f"MoE experts '{name}.{pname}' has FFN width {p.shape[params[pname][0]]}, not divisible by"
                    f" tensor_parallel({self.tp})."
                )
        return params

    def _stacked_params(self, name: str, module: nn.Module) -> dict:
        """2-D weights stacking every expert's FFN rows (DBRX): each rank holds its slice of every expert's rows, the
        pieces of a packing, and the forward views them with this rank's FFN width."""
        child, weights, width_attr, count_attr = fam.STACKED_EXPERTS[type(module).__name__]
        width, count = getattr(module, width_attr), getattr(module, count_attr)
        packing = Packing(0, (width,) * count, self.tp)  # refuses a width the degree does not divide
        params = {}
        for weight in weights:
            params[f"{child}.{weight}"] = (0, packing)
            self.result.packings[_join(name, f"{child}.{weight}")] = packing
        self.result.local_counts[name] = {width_attr: width // self.tp}
        return params


def fused_experts(module: nn.Module, biases: bool = False) -> bool:
    """transformers-style fused experts: 3-D expert weights such as gate_up_proj (E, 2I, H), down_proj (E, H, I);
    with ``biases``, also (E, out) biases beside them (GPT-OSS)."""
    params = {n: p for n, p in module.named_parameters(recurse=False) if not (biases and p.dim() == 2 and n.endswith("bias"))}
    return len(params) >= 2 and all(p.dim() == 3 for p in params.values()) and any("down" in n or n == "w2" for n in params)


def stacked_experts(module: nn.Module) -> bool:
    """Experts stored as 2-D weights stacking each expert's FFN rows (families.STACKED_EXPERTS)."""
    return type(module).__name__ in fam.STACKED_EXPERTS
