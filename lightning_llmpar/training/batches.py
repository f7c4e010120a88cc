"""What the package needs to know about a batch, whatever its structure (tensor, tuple, dict, nested)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["batch_size", "batch_tensors", "batch_tokens", "first_tensor", "train_batch_sizes"]


def first_tensor(batch: Any) -> Tensor | None:
    """The first tensor with a batch dimension: ``input_ids`` of a dict batch if there is one."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), Tensor):
        return batch["input_ids"]
    for leaf in torch.utils._pytree.tree_leaves(batch):
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return leaf
    return None


def batch_tensors(batch: Any) -> list[Tensor]:
    """Every tensor in ``batch``, in order, through dicts and any mapping (a tokenizer's ``BatchEncoding``), lists
    and tuples."""
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in batch_tensors(value)]
    if isinstance(batch, (list, tuple)):
        return [t for value in batch for t in batch_tensors(value)]
    return []


def batch_size(batch: Any) -> int:
    """Samples in ``batch`` (dim 0 of its first tensor): a dict's length is its number of keys, not samples."""
    tensor = first_tensor(batch)
    if tensor is None:
        raise ValueError(f"Cannot tell the number of samples of a {type(batch).__name__} batch without a tensor in it.")
    return tensor.shape[0]


def batch_tokens(batch: Any) -> int:
    """Tokens in ``batch``: elements of its input ids (or first tensor)."""
    tensor = first_tensor(batch)
    return int(tensor.numel()) if tensor is not None else 0


def train_batch_sizes(trainer: Any) -> list[tuple[int, int]]:
    """(batch size, size of the epoch's short last batch or 0) of each training DataLoader whose sizes are known."""
    loader = trainer.train_dataloader
    loaders = getattr(loader, "flattened", None) or ([loader] if loader is not None else [])
    sizes = []
    for dl in loaders:
        size, sampler = getattr(dl, "batch_size", None), getattr(dl, "sampler", None)
        try:
            samples = len(sampler)  # type: ignore[arg-type]
        except TypeError:
            continue  # iterable datasets: checked batch by batch
        if isinstance(size, int) and size > 0:
            sizes.append((size, 0 if getattr(dl, "drop_last", False) else samples % size))
    return sizes
