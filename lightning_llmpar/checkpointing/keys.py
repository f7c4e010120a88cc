"""The checkpoint's model entries against the model's, checked before DCP reads a byte.

DCP plans a load from the model's own keys: an entry the model lacks is skipped without a word, and a missing
or resized one fails deep inside its collective with a ``CheckpointException`` (not an ``Exception``) naming one
key. Every rank holds only its part of a pipeline-split model, so the ranks pool their keys and all raise the
same ``ValueError``, naming every entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = ["check_model_keys"]
_SHOWN = 8


def _pooled(keys: set[str], resized: list[str]) -> tuple[set[str], list[str]]:
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return keys, resized
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (sorted(keys), resized))  # names and shapes only, between this run's processes
    return {k for part in parts for k in part[0]}, sorted({r for part in parts for r in part[1]})


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def check_model_keys(path: Path, metadata: Metadata, model_state: Mapping[str, Any], *, strict: bool) -> None:
    """Raise a ``ValueError`` on every rank where the checkpoint at ``path`` does not fit the model: entries of a
    different shape always, missing or unexpected ones when ``strict`` (a LightningModule's ``strict_loading``)."""
    saved = {k[len("model."):]: m for k, m in metadata.state_dict_metadata.items() if k.startswith("model.")}
    resized = []
    for name, value in model_state.items():
        meta = saved.get(name)
        if isinstance(value, torch.Tensor) and isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(value.shape):
            resized.append(f"{name} (saved {tuple(meta.size)}, model {tuple(value.shape)})")
    keys, resized = _pooled(set(model_state), resized)
    missing = sorted(keys - saved.keys()) if strict else []
    unexpected = sorted(saved.keys() - keys) if strict else []
    if not (resized or missing or unexpected):
        return
    found = [f"{len(names)} {'entries' if len(names) > 1 else 'entry'} {label} ({_listed(names)})" for label, names in
             (("of another shape", resized), ("missing from the checkpoint", missing),
              ("not in the model", unexpected)) if names]
    lenient = "" if resized else " or, to load only the entries both have, set the LightningModule's strict_loading = False"
    raise ValueError(
        f"Checkpoint {path} was not saved from this model: {'; '.join(found)}. Resume with the model"
        f" configuration it was saved with (layers, widths, vocabulary){lenient}."
    )
