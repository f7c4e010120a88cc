"""Fused projections split per piece: each rank holds its share of every piece, side by side.

A fused weight concatenates pieces along one dim: ``[q; k; v]`` rows of a qkv projection, ``[gate; up]``
of a gated MLP, the ``[gate; up]`` halves of fused MoE experts. A plain column split would hand a rank
a mix of pieces; instead rank ``r`` holds the ``r``-th slice of every piece, ``[q_r; k_r; v_r]``, which
is exactly the local layout the model's own split code expects once its head counts are per rank.

As a DTensor that parameter is an ordinary ``Shard(dim)`` of the *packed* tensor
``[q_0; k_0; v_0; q_1; k_1; v_1; ...]`` (so FSDP2, clipping and optimizers work unchanged). The packed
order depends on the tensor-parallel degree, so wherever the global tensor leaves the process it is
translated back to the model's own (canonical) order: ``canonical_view`` presents a rank's data to
torch.distributed.checkpoint as chunks of the canonical tensor (checkpoints reshard to any layout),
``canonical_regions`` tells a loader which slices of a file tensor a rank needs, and ``to_canonical``
reorders a gathered tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["Packing", "canonical_view", "canonical_regions", "local_region", "on_rows", "to_canonical", "to_packed"]


@dataclass(frozen=True)
class Packing:
    """``sizes``: the pieces along ``dim`` in canonical order; ``tp``: how many slices each is cut into."""

    dim: int
    sizes: tuple[int, ...]
    tp: int

    def __post_init__(self) -> None:
        bad = [s for s in self.sizes if s % self.tp]
        if bad:
            raise ValueError(
                f"A fused projection with pieces {list(self.sizes)} along dim {self.dim} cannot be split over"
                f" tensor_parallel({self.tp}): piece sizes {bad} are not divisible by it."
            )

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def order(self) -> Tensor:
        """``order[i]``: canonical index of packed index ``i``."""
        starts = [sum(self.sizes[:j]) for j in range(len(self.sizes))]
        index = [start + r * (size // self.tp) + k for r in range(self.tp) for start, size in zip(starts, self.sizes)
                 for k in range(size // self.tp)]
        return torch.tensor(index, dtype=torch.long)

    def runs(self, start: int, length: int) -> list[tuple[int, int, int]]:
        """Packed range [start, start + length) as (offset in it, canonical start, length) runs."""
        order = self.order()[start : start + length].tolist()
        runs: list[tuple[int, int, int]] = []
        for offset, canonical in enumerate(order):
            if runs and runs[-1][1] + runs[-1][2] == canonical:
                first, begin, size = runs[-1]
                runs[-1] = (first, begin, size + 1)
            else:
                runs.append((offset, canonical, 1))
        return runs


def on_rows(packing: Packing | None) -> Packing | None:
    """The same pieces along dim 0: a projection's bias, or its LoRA ``lora_B`` (an nn.Linear even around a Conv1D)."""
    return None if packing is None else Packing(0, packing.sizes, packing.tp)


def to_packed(tensor: Tensor, packing: Packing) -> Tensor:
    """Reorder a canonical tensor along ``packing.dim`` into the packed order (before sharding it)."""
    return tensor.index_select(packing.dim, packing.order().to(tensor.device))


def to_canonical(tensor: Tensor, packing: Packing) -> Tensor:
    """Inverse of :func:`to_packed`, for a gathered (full) tensor."""
    inverse = torch.empty_like(packing.order())
    inverse[packing.order()] = torch.arange(packing.total)
    return tensor.index_select(packing.dim, inverse.to(tensor.device))


def local_region(tensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sizes, offsets) of this rank's data in the DTensor's global tensor."""
    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(sizes), tuple(offsets)


def canonical_regions(
    sizes: Sequence[int], offsets: Sequence[int], packing: Packing | None
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """This rank's data as rectangles of the canonical tensor: (canonical offsets, sizes, local offsets)."""
    if packing is None:
        return [(tuple(offsets), tuple(sizes), (0,) * len(sizes))]
    d = packing.dim
    out = []
    for local, begin, length in packing.runs(offsets[d], sizes[d]):
        canon = list(offsets)
        canon[d] = begin
        size = list(sizes)
        size[d] = length
        start = [0] * len(sizes)
        start[d] = local
        out.append((tuple(canon), tuple(size), tuple(start)))
    return out


class _CanonicalView(Tensor):
    """What torch.distributed.checkpoint sees for a packed parameter: this rank's data as chunks of the
    canonical tensor (the protocol DTensor implements: write items, chunk list, shard lookup)."""

    _chunks: list[tuple[torch.Size, torch.Size, Tensor]]
    _dtensor: DTensor

    @staticmethod
    def __new__(cls, dtensor: DTensor, packing: Packing) -> _CanonicalView:
        local = dtensor.to_local()
        view = Tensor._make_wrapper_subclass(cls, dtensor.shape, dtype=local.dtype, device=local.device)
        sizes, offsets = local_region(dtensor)
        view._chunks = []
        for canon, size, start in canonical_regions(sizes, offsets, packing):
            data = local
            for dim, (begin, length) in enumerate(zip(start, size)):
                data = data.narrow(dim, begin, length)
            view._chunks.append((torch.Size(canon), torch.Size(size), data))
        view._dtensor = dtensor
        return view

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"A packed-parameter checkpoint view only takes part in checkpointing, not in {func}.")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties.create_from_tensor(data),
                    size=self.size(),
                ),
            )
            for offsets, sizes, data in self._chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        for offsets, _, data in self._chunks:
            if index.offset is None or offsets == index.offset:
                return data
        raise ValueError(f"No chunk of '{index.fqn}' starts at {index.offset} on this rank.")


def canonical_view(dtensor: DTensor, packing: Packing) -> Tensor:
    """Wrap a packed DTensor for torch.distributed.checkpoint; loading writes into its local data in place."""
    return _CanonicalView(dtensor, packing)


def unwrap(value: Any) -> Any:
    """The DTensor behind a :func:`canonical_view` (anything else unchanged)."""
    return value._dtensor if isinstance(value, _CanonicalView) else value
