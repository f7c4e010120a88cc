"""Token dispatch for expert parallelism: each token's (token, expert) assignments travel to the rank holding the
expert and back, with one all-to-all each way on torch's functional collectives (autograd through both).

Experts are laid out in blocks: rank r of the expert-parallel group holds global experts r*E/ep .. (r+1)*E/ep-1,
so sorting assignments by expert id also sorts them by destination rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

__all__ = ["Routing", "route", "dispatch", "combine"]


@dataclass
class Routing:
    """Where this rank's assignments went: ``order`` (kept assignments, sorted by expert), their ``tokens`` and
    ``weights``, the split sizes both ways, and each received row's local expert."""

    order: Tensor
    tokens: Tensor
    weights: Tensor
    send: list[int]
    recv: list[int]
    local_experts: Tensor
    counts: Tensor  # assignments per global expert before the capacity cut (for metrics)
    dropped: int


def route(
    top_k_index: Tensor,
    top_k_weights: Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None,
    ep: int,
    capacity_factor: float | None,
) -> Routing:
    """Sort this rank's assignments by expert, cut each expert at its capacity, and exchange the counts."""
    n_tokens, k = top_k_index.shape
    experts = top_k_index.reshape(-1)
    counts = torch.bincount(experts, minlength=num_experts)
    order = torch.argsort(experts, stable=True)  # by expert, then by token: later tokens drop first
    kept_counts = counts
    if capacity_factor is not None:
        # GShard / Switch: each expert takes at most capacity_factor x its even share of this rank's assignments.
        capacity = math.ceil(capacity_factor * n_tokens * k / num_experts)
        start = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=order.device) - start.repeat_interleave(counts)
        order = order[position < capacity]
        kept_counts = counts.clamp(max=capacity)
    local = num_experts // ep
    send_counts = kept_counts.reshape(ep, local)
    if ep > 1:
        recv_counts = all_to_all_single(send_counts.flatten(), None, None, group).reshape(ep, local)
    else:
        recv_counts = send_counts
    return Routing(
        order=order,
        tokens=torch.div(order, k, rounding_mode="floor"),
        weights=top_k_weights.reshape(-1)[order],
        send=send_counts.sum(1).tolist(),
        recv=recv_counts.sum(1).tolist(),
        local_experts=torch.arange(local, device=order.device).repeat(ep).repeat_interleave(recv_counts.flatten()),
        counts=counts,
        dropped=int(counts.sum() - kept_counts.sum()),
    )


def dispatch(hidden: Tensor, routing: Routing, group: dist.ProcessGroup | None) -> Tensor:
    """The tokens of this rank's kept assignments, delivered to the ranks holding their experts: rows grouped by
    source rank, then by local expert."""
    rows = hidden[routing.tokens]
    if group is None:
        return rows
    return all_to_all_single_autograd(rows, routing.recv, routing.send, group)


def combine(expert_out: Tensor, routing: Routing, n_tokens: int, group: dist.ProcessGroup | None) -> Tensor:
    """Expert outputs back to the tokens' ranks, weighted by routing weight and summed over each token's experts."""
    if group is not None:
        expert_out = all_to_all_single_autograd(expert_out, routing.send, routing.recv, group)
    weighted = expert_out * routing.weights[:, None].to(expert_out.dtype)
    out = expert_out.new_zeros(n_tokens, expert_out.shape[-1])
    return out.index_add(0, routing.tokens, weighted)
