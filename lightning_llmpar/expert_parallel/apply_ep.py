"""Expert parallelism: every MoE layer's experts are split over the expert-parallel ranks (a block of experts per
rank, as torchtitan and Megatron-Core do), and tokens travel to their experts and back with all-to-all.

An experts module is one that holds its experts' weights as 3-D tensors (expert, out, in) and is called with
(tokens, top-k expert indices, top-k routing weights): transformers' Mixtral, Qwen3-MoE, Qwen2-MoE, ... and the
example GPT's ``Experts``. Its own forward still does the expert math: it is called with the tokens this rank
received, each one's local expert, and weight 1; the routing weights are applied after the return trip. The router
stays where it is, replicated, so the load-balancing loss each model computes is unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_llmpar.expert_parallel.dispatch import combine, dispatch, route
from lightning_llmpar.tensor_parallel.moe import fused_experts

__all__ = ["ExpertParallel", "apply_expert_parallel", "check_experts", "expert_lists", "find_experts"]


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The experts modules of ``model`` by name: 3-D expert weights, called with tokens, indices and weights."""
    found = {}
    for name, module in model.named_modules():
        if not fused_experts(module, biases=True):
            continue
        params = [p for p in inspect.signature(module.forward).parameters.values() if p.kind != p.VAR_KEYWORD]
        if len(params) < 3:
            raise ValueError(
                f"'{name}' ({type(module).__name__}) holds 3-D expert weights but its forward takes"
                f" ({', '.join(p.name for p in params)}), not (tokens, top_k_index, top_k_weights): expert parallelism"
                " cannot route tokens to it. Use expert_parallel=1 for this model."
            )
        found[name] = module
    return found


def _num_experts(module: nn.Module) -> int:
    """Experts in an experts module: dim 0 of its 3-D weights (the global count, also once they are sharded)."""
    return next(module.parameters()).shape[0]


def expert_lists(model: nn.Module) -> list[str]:
    """MoE layers whose experts are a list of MLP modules (LitGPT's LLaMAMoE): routed inside the layer's forward."""
    return [
        f"{name}.{child}" if name else child
        for name, module in model.named_modules()
        for child, sub in module.named_children()
        if isinstance(sub, nn.ModuleList) and len(sub) > 1 and hasattr(module, "gate") and "expert" in child
    ]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times ``scale`` (see ``ExpertParallel.wrap``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class ExpertParallel:
    """The expert-parallel state of one model: its experts modules, the group, and this step's routing metrics."""

    def __init__(self, experts: dict[str, nn.Module], mesh: DeviceMesh | None, capacity_factor: float | None) -> None:
        self.experts = experts
        # Global experts per layer (the same in every layer: metrics add layers up per expert).
        self.num_experts = max(_num_experts(m) for m in experts.values())
        self.ep = mesh.size() if mesh is not None else 1
        self.group = mesh.get_group() if mesh is not None and self.ep > 1 else None
        self.capacity_factor = capacity_factor
        self.counts: dict[str, Tensor] = {}  # assignments per global expert, per layer, this step
        self.dropped = 0
        self.bytes_sent = 0
        self.recording: Callable[[], bool] = lambda: True  # False on a pipeline's shape-learning run (compose)

    def shard(self, mesh: DeviceMesh) -> None:
        """Keep this rank's block of experts: a DTensor sharded on dim 0 over 'ep' (in front of a tensor-parallel
        split of each expert, when there is one)."""
        rank = mesh["ep"].get_local_rank()
        for module in self.experts.values():
            for pname, p in list(module.named_parameters(recurse=False)):
                if isinstance(p, DTensor):
                    sub, placements = mesh[("ep", *p.device_mesh.mesh_dim_names)], [Shard(0), *p.placements]
                    local = p.to_local()
                else:
                    sub, placements, local = mesh["ep"], [Shard(0)], p.detach()
                block = local.chunk(self.ep)[rank].clone()
                value = DTensor.from_local(block, sub, placements, shape=p.shape, stride=p.stride())
                module.register_parameter(pname, nn.Parameter(value, requires_grad=p.requires_grad))

    def wrap(self, name: str, module: nn.Module) -> None:
        """Route ``module``'s calls: its tokens go to their experts' ranks and back around its own forward."""
        num_experts = _num_experts(module)
        original: Callable[..., Tensor] = module.forward
        signature = inspect.signature(original)
        names = [n for n, _ in module.named_parameters(recurse=False)]
        local_experts = num_experts // self.ep

        @torch.compiler.disable  # run eagerly in compiled blocks: traced routing-dependent splits would recompile
        def forward(*args: Any, **kwargs: Any) -> Tensor:
            hidden, index, weights = list(signature.bind(*args, **kwargs).arguments.values())[:3]
            routing = route(index, weights, num_experts, self.group, self.ep, self.capacity_factor)
            rows = dispatch(hidden, routing, self.group)
            held = {n: module._parameters[n] for n in names}
            had = getattr(module, "num_experts", None)
            for n, p in held.items():
                # Each rank's experts see the tokens of all ep ranks, so their gradient sums ep ranks' losses; data
                # parallelism then averages over the remaining dp / ep ranks. 1/ep makes it the mean over dp.
                local = p.to_local() if isinstance(p, DTensor) else p
                module._parameters[n] = _ScaleGrad.apply(local, 1.0 / self.ep) if self.ep > 1 else local  # type: ignore[assignment]
            if had is not None:
                module.num_experts = local_experts
            try:
                out = original(rows, routing.local_experts[:, None], rows.new_ones(rows.shape[0], 1, dtype=weights.dtype))
            finally:
                module._parameters.update(held)
                if had is not None:
                    module.num_experts = had
            self._record(name, routing, hidden)
            return combine(out, routing, hidden.shape[0], self.group)

        module.forward = forward  # type: ignore[method-assign]

    def _record(self, name: str, routing: Any, hidden: Tensor) -> None:
        # Training forwards only: not activation checkpointing's recomputation (it runs inside backward), nor a
        # pipeline stage's run on placeholders.
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1 or not self.recording():
            return
        counts = routing.counts.detach()
        self.counts[name] = self.counts[name] + counts if name in self.counts else counts.clone()
        self.dropped += routing.dropped
        rank = dist.get_rank(self.group) if self.group is not None else 0
        remote = sum(n for r, n in enumerate(routing.send) if r != rank)
        # Rows leaving this rank: dispatch and combine forward, the same again in backward.
        self.bytes_sent += 4 * remote * hidden.shape[-1] * hidden.element_size()

    def step_metrics(self, data_group: dist.ProcessGroup | None, replicas: int) -> dict[str, float]:
        """This step's routing over all ranks, then reset: tokens per expert (summed over layers), the worst
        layer's imbalance (max / mean), dropped assignments, this rank's bytes sent. ``data_group``: the ranks that
        hold the same layers and route different tokens (data- and context-parallel ranks; None: every process);
        ``replicas``: ranks that route the same tokens (tensor-parallel ones)."""
        layers = torch.stack([self.counts[n] for n in sorted(self.counts)]).double() if self.counts else None
        if layers is None:  # this rank's layers routed nothing (no MoE layer on its pipeline stage)
            layers = torch.zeros(1, self.num_experts, dtype=torch.float64)
        dropped = torch.tensor([float(self.dropped)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(layers, group=data_group)
        imbalance = (layers.max(1).values / layers.mean(1).clamp(min=1)).max().reshape(1)
        totals = torch.cat([layers.sum(0), dropped])
        if dist.is_initialized():
            # Pipeline stages hold different layers: the totals add up over the whole world.
            totals[:-1] /= dist.get_world_size(data_group)  # every rank of the group now holds the group's sum
            dist.all_reduce(totals)
            dist.all_reduce(imbalance, op=dist.ReduceOp.MAX)
        totals /= replicas
        metrics = {f"moe/expert_{e}_tokens": float(v) for e, v in enumerate(totals[:-1])}
        metrics["moe/dropped_tokens"] = float(totals[-1])
        metrics["moe/dropped_fraction"] = float(totals[-1] / totals[:-1].sum().clamp(min=1))
        metrics["moe/imbalance"] = float(imbalance)
        metrics["ep/bytes_sent"] = float(self.bytes_sent)
        self.counts, self.dropped, self.bytes_sent = {}, 0, 0
        return metrics

def check_experts(experts: dict[str, nn.Module], ep: int) -> None:
    for name, module in experts.items():
        num = _num_experts(module)
        if num % ep:
            raise ValueError(
                f"'{name}' has {num} experts, not divisible by expert_parallel({ep}): every rank must hold as many."
                f" Use an expert_parallel degree that divides {num}."
            )


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh | None, capacity_factor: float | None) -> ExpertParallel:
    """Shard every experts module of ``model`` over ``mesh['ep']`` (``mesh`` None: one rank holds all experts and
    only the capacity cut and the metrics apply)."""
    experts = find_experts(model)
    if not experts:
        lists = expert_lists(model)
        found = f" Its MoE layers keep experts as module lists ({', '.join(lists[:3])})." if lists else ""
        raise ValueError(
            f"expert_parallel / expert_capacity_factor need MoE layers whose experts are one module with 3-D weights"
            f" (expert, out, in) called with (tokens, top_k_index, top_k_weights), as transformers' MoE models and the"
            f" example GPT's n_expert option have; {type(model).__name__} has none.{found} Use expert_parallel=1"
            " (experts are then replicated or sharded by ZeRO)."
        )
    check_experts(experts, mesh["ep"].size() if mesh is not None else 1)
    ep = ExpertParallel(experts, mesh["ep"] if mesh is not None else None, capacity_factor)
    if mesh is not None:
        ep.shard(mesh)
    for name, module in experts.items():
        ep.wrap(name, module)
    return ep
