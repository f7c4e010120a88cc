"""Fewer key/value heads than tensor-parallel ranks: multi-query attention (Falcon-7B, StarCoder, Gemma-2B), or
grouped-query attention at a degree above its key/value heads.

Each rank keeps its share of the query heads, which all read one key/value head; a key/value head cannot be cut
between ranks. The key/value projection is stored split like any column split (FSDP2, clipping, the optimizer and
checkpoints see an ordinary shard, the same as at a degree that divides the heads) and gathered whole in the
forward, where each rank keeps the head its query heads read. Ranks sharing a head each give it part of its
gradient, so the gather's backward sums them over the ranks and hands each its shard (a reduce-scatter): exact,
as vLLM's replicated key/value heads and the Megatron fork that trained StarCoder (its one key/value head whole on
every rank, the gradient all-reduced). For a fused projection only its key and value pieces are gathered; the
query piece stays this rank's slice.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_llmpar.modeling.packing import Packing, on_rows
from lightning_llmpar.tensor_parallel.lora import check_lora, is_lora
from lightning_llmpar.tensor_parallel.styles import (
    _distribute,
    _identity_forward_sum_backward,
    _local_params_in_forward,
    _region_input,
    is_conv1d,
)

__all__ = ["SharedKVHeads", "shared_kv_heads"]


def shared_kv_heads(kv_heads: int, tp: int) -> bool:
    """Whether key/value heads are shared between ranks: fewer than the ranks, each rank's query heads reading one.
    (A count that neither divides nor is divided by the degree is refused by the planner.)"""
    return kv_heads < tp and tp % kv_heads == 0


class SharedKVHeads(ParallelStyle):
    """A column split of a key/value projection (``packing``: None) or of a fused q/k/v projection (``packing``: its
    pieces, ``shared``: which of them are key/value heads) whose ``kv_heads`` are fewer than the ranks."""

    def __init__(self, kv_heads: int, packing: Packing | None = None, shared: tuple[bool, ...] = (True,)) -> None:
        super().__init__()
        self.kv_heads, self.packing, self.shared = kv_heads, packing, shared

    def _local(self, name: str, param: DTensor, dim: int) -> Tensor:
        mesh = param.device_mesh
        tp, rank = mesh.size(), mesh.get_local_rank()
        sizes = self.packing.sizes if self.packing is not None else (param.shape[dim],)
        parts = param.to_local().split([s // tp for s in sizes], dim)
        kept = []
        for part, size, shared in zip(parts, sizes, self.shared):
            if shared:
                whole = DTensor.from_local(part, mesh, (Shard(dim),), run_check=False)
                whole = whole.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),))
                width = size // self.kv_heads
                part = whole.narrow(dim, rank * self.kv_heads // tp * width, width)  # the head this rank's queries read
            kept.append(part)
        return torch.cat(kept, dim) if len(kept) > 1 else kept[0]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if is_lora(module):
            return self._split_lora(module, device_mesh)
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise ValueError(f"SharedKVHeads splits nn.Linear or transformers Conv1D layers, not {type(module).__name__}.")
        out_dim = 1 if is_conv1d(module) else 0
        module.register_parameter("weight", _distribute(module.weight, device_mesh, Shard(out_dim), self.packing))
        names = ["weight"]
        if isinstance(getattr(module, "bias", None), Tensor):
            module.register_parameter("bias", _distribute(module.bias, device_mesh, Shard(0), on_rows(self.packing)))
            names.append("bias")
        _local_params_in_forward(module, names, lambda n, p: self._local(n, p, out_dim if n == "weight" else 0))

        def before(mod: nn.Module, args: tuple) -> tuple:
            # This rank's heads give the input part of its gradient: summed over the ranks with the region's other
            # column splits (one reduction per region), or on its own where the region's input is not known.
            shared = _region_input(args[0], device_mesh)
            x = (shared.to_local(grad_placements=(Partial(),)) if shared is not None
                 else _identity_forward_sum_backward(args[0], device_mesh))
            return (x, *args[1:])

        module.register_forward_pre_hook(before)
        return module

    def _split_lora(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """A peft LoRA layer: the base layer split so, ``lora_A`` whole on the replicated input and ``lora_B`` split and
        gathered as the base layer is, so ``lora_B(lora_A(x))`` has the base output's heads. Ranks sharing a head
        give ``lora_B`` parts of its gradient (reduce-scattered as the base weight's), and their sum over the ranks
        reaches ``lora_A`` through lora_B's input, the same on every rank, as for any column split (lora.py)."""
        check_lora(module, type(module).__name__)
        self._apply(module.base_layer, mesh)
        for lora_b in module.lora_B.values():
            SharedKVHeads(self.kv_heads, on_rows(self.packing), self.shared)._apply(lora_b, mesh)
        return module

    def __repr__(self) -> str:
        packed = f", packing={self.packing.sizes}, shared={self.shared}" if self.packing is not None else ""
        return f"SharedKVHeads(kv_heads={self.kv_heads}{packed})"
