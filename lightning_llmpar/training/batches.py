"""What the package needs to know about a batch, whatever its structure (tensor, tuple, dict, nested)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["ITEM_COUNT", "batch_rows", "batch_size", "batch_tensors", "batch_tokens", "first_tensor", "same_sequence",
           "share_item_count", "train_batch_sizes"]

ITEM_COUNT = "num_items_in_batch"  # transformers' batch-wide count of valid targets, which its loss divides a sum by


def first_tensor(batch: Any) -> Tensor | None:
    """The first tensor with a batch dimension: ``input_ids`` of a dict batch if there is one."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor):
        return batch["input_ids"]
    return next((t for t in batch_tensors(batch) if t.dim() > 0), None)


def _fields(batch: Any) -> dict[str, Any] | None:
    """A dataclass batch's init fields by name (None for anything else)."""
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.init}
    return None


def batch_tensors(batch: Any) -> list[Tensor]:
    """Every tensor in ``batch``, in order, through dicts and any mapping (a tokenizer's ``BatchEncoding``), lists,
    tuples and dataclasses."""
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in batch_tensors(value)]
    if isinstance(batch, (list, tuple)):
        return [t for value in batch for t in batch_tensors(value)]
    fields = _fields(batch)
    return batch_tensors(list(fields.values())) if fields is not None else []


def batch_rows(batch: Any, start: int, stop: int, size: int) -> Any:
    """Samples ``start:stop`` of a batch of ``size``, in its structure: tensors whose first dimension is the batch's
    sliced, as are per-sample lists (strings, numbers: as many as the batch's samples and no tensor among them);
    anything else (a constant, a tensor of another length) whole."""
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == size else batch
    if isinstance(batch, Mapping):
        rows = {k: batch_rows(v, start, stop, size) for k, v in batch.items()}
        return rows if type(batch) is dict else _rebuilt(batch, rows)
    if isinstance(batch, (list, tuple)):
        if len(batch) == size and not batch_tensors(batch):  # one entry per sample (texts, ids, weights)
            items = list(batch[start:stop])
        else:
            items = [batch_rows(v, start, stop, size) for v in batch]
        return same_sequence(batch, items)
    fields = _fields(batch)
    if fields is not None:
        return dataclasses.replace(batch, **{k: batch_rows(v, start, stop, size) for k, v in fields.items()})
    return batch


def share_item_count(rows: Any, parts: int, tokens: Any) -> Any:
    """A microbatch (one of ``parts``) of a dict batch that carries transformers' ``num_items_in_batch``, with the
    count its loss must divide its sum by for the step to be one process's: the batch's count over ``parts``
    (the microbatches' losses are averaged), or where tokens are counted (``tokens``, a ``TokenNormalizer``) the
    microbatch's own, at least 1 (its mean, weighed by its tokens). Whole, every part would divide by the batch's."""
    if not isinstance(rows, Mapping) or ITEM_COUNT not in rows:
        return rows
    whole = rows[ITEM_COUNT]
    share = max(int(tokens.count(rows)), 1) if tokens is not None else whole / parts
    if isinstance(whole, Tensor):
        share = torch.as_tensor(share, dtype=torch.float32, device=whole.device)
    shared = {**rows, ITEM_COUNT: share}
    return shared if type(rows) is dict else _rebuilt(rows, shared)


def same_sequence(like: list | tuple, items: list[Any]) -> Any:
    """``items`` as a sequence of ``like``'s type: a list, a tuple, or a named tuple (built by its fields)."""
    return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)


def _rebuilt(batch: Mapping, rows: dict[str, Any]) -> Any:
    """A mapping of another type (a tokenizer's ``BatchEncoding``) rebuilt from ``rows``, or a dict if it cannot be."""
    try:
        return type(batch)(rows)
    except Exception:  # noqa: BLE001 - a mapping type without a constructor from a dict
        return rows


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
