"""Blocks whose regions use their input beyond the column projections, and the collective counts of one step.

Helpers for test_regions.py, importable by the worker processes."""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

WIDTH, HEADS, SEQ, BLOCKS = 32, 4, 8, 2


class Attention(nn.Module):
    """q/k/v/o. ``reader``: the region uses its input beyond the three projections reading it as given:
    ``"copy"``: v reads a copy; ``"gate"``: the output is scaled by a statistic of the whole input (a
    parameter-free reader whose gradient is complete on every rank while the output is whole, i.e. without
    sequence parallelism)."""

    def __init__(self, reader: str) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.reader = HEADS, WIDTH // HEADS, reader
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = (p(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj))
        v = self.v_proj(x * 1 if self.reader == "copy" else x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        out = self.o_proj(y)
        return out * torch.sigmoid(x.mean()) if self.reader == "gate" else out


class MLP(nn.Module):
    """gate/up/down; with ``inplace`` the input is scaled in place before the projections read it."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.gate_proj, self.up_proj = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, 2 * WIDTH)
        self.down_proj = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            x.mul_(1.5)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, reader: str, inplace: bool) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn, self.mlp = Attention(reader), MLP(inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Stack(nn.Module):
    def __init__(self, reader: str = "", inplace: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(reader, inplace) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Collectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func)
        if name.startswith("_c10d_functional.") and "wait" not in name and "wrap" not in name:
            self.calls[name.split(".")[1]] += 1
        elif name.startswith("c10d."):  # torch.distributed's own calls
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def run_case(reader: str, inplace: bool, sequence_parallel: bool, compile: bool = False) -> dict[str, Any]:
    """One forward/backward of ``Stack`` at tp2 on this rank against the same step in one process (computed here),
    with its blocks compiled when ``compile``."""
    import torch.distributed as dist

    from lightning_llmpar.layout import ParallelLayout
    from lightning_llmpar.parallelize import ParallelConfig, parallelize
    from lightning_llmpar.tensor_parallel.grads import reduce_partial_grads
    from tests.workloads import full

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        reference = Stack(reader, inplace)
        model = Stack(reader, inplace)
        model.load_state_dict(reference.state_dict())
        x = torch.randn(2, SEQ, WIDTH, generator=torch.Generator().manual_seed(1))
        reference(x).pow(2).mean().backward()
        layout = ParallelLayout(world_size=2, tp=2)
        mesh, _ = layout.build_mesh("cpu")
        parallelize(model, layout, mesh, ParallelConfig(sequence_parallel=sequence_parallel, compile=compile))
        counter, completing = _Collectives(), _Collectives()
        loss = model(x).pow(2).mean()
        with counter:
            loss.backward()
        partial = sorted(n for n, p in model.named_parameters() if "Partial" in str(getattr(p.grad, "placements", "")))
        with completing:
            completed = reduce_partial_grads(model.parameters())
        left = [n for n, p in model.named_parameters() if "Partial" in str(getattr(p.grad, "placements", ""))]
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        error = max((grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
        return {"grad_error": error, "backward": dict(counter.calls), "partial": partial, "completed": completed,
                "completing": dict(completing.calls), "left": left}
    finally:
        dist.destroy_process_group()
