"""Checkpoints saved in another layout than the model's, read per rank: transformers' own conversion mapping gives
renamed keys (Mixtral's ``block_sparse_moe`` -> ``mlp``), per-expert tensors stacked into fused experts
(MergeModulelist + Concatenate) and tensors joined into one (Kimi Linear's q/k/v convolutions: Concatenate). Each
rank reads only the regions of the file tensors its shards cover."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Source", "conversions", "read", "source_shape"]


@dataclass
class Source:
    """Where a model tensor comes from: a file tensor, per-expert file tensors stacked (legacy MoE), or file tensors
    concatenated (Kimi Linear's q/k/v convolutions)."""

    key: str | None = None
    experts: list[list[str]] | None = None  # [piece][expert] -> file key, pieces concatenated along ``dim``
    dim: int = 1
    pieces: list[str] | None = None  # file keys concatenated along ``dim``

    def keys(self) -> list[str]:
        if self.key is not None:
            return [self.key]
        return list(self.pieces or []) + [k for keys in self.experts or [] for k in keys]


def conversions(model: nn.Module, files: Any) -> tuple[dict[str, Source], list[str]]:
    """Model key -> source for checkpoints saved in another layout, from transformers' own conversion mapping:
    renamed keys, per-expert tensors stacked and concatenated into fused experts (MergeModulelist + Concatenate),
    tensors joined into one (Concatenate). Other conversions are not sliceable here: the second value names those
    the checkpoint needs."""
    try:
        from transformers.conversion_mapping import extract_weight_conversions_for_model
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming
    except ImportError:
        return {}, []
    transforms = extract_weight_conversions_for_model(model) or []
    renames = [t for t in transforms if isinstance(t, WeightRenaming) and not isinstance(t, WeightConverter)]
    renamed: dict[str, str] = {}
    for key in files.where:
        new = key
        for r in renames:
            for src, tgt in zip(r.source_patterns, r.target_patterns):
                new = re.sub(src, tgt, new)
        renamed[key] = new
    out = {new: Source(key=key) for key, new in renamed.items() if new != key}
    skipped: list[str] = []
    for conv in (t for t in transforms if isinstance(t, WeightConverter)):
        ops = list(conv.operations)
        # Patterns are regular expressions where '*' stands for an index, as transformers reads them.
        pieces = [re.compile(p.replace("*", r"(\d+)") + "$") for p in conv.source_patterns]
        if len(ops) == 1 and isinstance(ops[0], Concatenate):
            _concatenated(out, renamed, pieces, conv.target_patterns[0], ops[0].dim)
            continue
        if not ops or not isinstance(ops[0], MergeModulelist) or any(not isinstance(o, Concatenate) for o in ops[1:]):
            if any(p.search(new) for p in pieces for new in renamed.values()):
                skipped.append(f"{', '.join(conv.source_patterns)} -> {', '.join(conv.target_patterns)}")
            continue
        dim = ops[1].dim if len(ops) > 1 else 1
        for key, new in renamed.items():
            for i, pattern in enumerate(pieces):
                match = pattern.search(new)
                if match is None:
                    continue
                source = out.setdefault(new[: match.start()] + conv.target_patterns[0],
                                        Source(experts=[[] for _ in pieces], dim=dim))
                slots = source.experts[i]  # type: ignore[index]
                expert = int(match.group(1))
                slots.extend([""] * (expert + 1 - len(slots)))
                slots[expert] = key
    return out, skipped


def _concatenated(out: dict[str, Source], renamed: dict[str, str], pieces: list[re.Pattern], target: str,
                  dim: int) -> None:
    """Targets made of several file tensors joined along ``dim``, found where all of their pieces are."""
    found: dict[str, list[str]] = {}
    for key, new in renamed.items():
        for i, pattern in enumerate(pieces):
            if (match := pattern.search(new)) is not None:
                found.setdefault(new[: match.start()] + target, [""] * len(pieces))[i] = key
    out.update({name: Source(pieces=keys, dim=dim) for name, keys in found.items() if all(keys)})


def read(files: Any, source: Source, canon: tuple[int, ...], size: tuple[int, ...]) -> Tensor:
    region = tuple(slice(o, o + s) for o, s in zip(canon, size))
    if source.key is not None:
        return files.read(source.key, region)
    if source.pieces is not None:
        parts, start = [], 0
        for key in source.pieces:
            rows = files.shape(key)[source.dim]
            lo, hi = max(canon[source.dim], start), min(canon[source.dim] + size[source.dim], start + rows)
            if lo < hi:
                sub = list(region)
                sub[source.dim] = slice(lo - start, hi - start)
                parts.append(files.read(key, tuple(sub)))
            start += rows
        return torch.cat(parts, dim=source.dim)
    # Legacy MoE: target (experts, rows, cols) = stack over experts of [piece 0; piece 1; ...] along source.dim.
    assert source.experts is not None
    rows_of = [files.shape(keys[0])[source.dim - 1] for keys in source.experts]
    out = []
    for e in range(canon[0], canon[0] + size[0]):
        parts, start = [], 0
        for keys, rows in zip(source.experts, rows_of):
            lo, hi = max(canon[source.dim], start), min(canon[source.dim] + size[source.dim], start + rows)
            if lo < hi:
                sub = list(region[1:])
                sub[source.dim - 1] = slice(lo - start, hi - start)
                parts.append(files.read(keys[e], tuple(sub)))
            start += rows
        out.append(torch.cat(parts, dim=source.dim - 1))
    return torch.stack(out)


def source_shape(files: Any, source: Source) -> tuple[int, ...]:
    if source.key is not None:
        return files.shape(source.key)
    if source.pieces is not None:
        shapes = [files.shape(key) for key in source.pieces]
        return (*shapes[0][: source.dim], sum(s[source.dim] for s in shapes), *shapes[0][source.dim + 1 :])
    assert source.experts is not None
    shapes = [files.shape(keys[0]) for keys in source.experts]
    merged = list(shapes[0])
    merged[source.dim - 1] = sum(s[source.dim - 1] for s in shapes)
    return (len(source.experts[0]), *merged)
