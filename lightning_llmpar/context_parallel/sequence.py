"""Each context-parallel rank's part of a batch: the same positions cut from every sequence-shaped tensor.

``ring`` takes chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp`` (head-tail: every rank gets as much of the causal
triangle as the others, the layout torch's ring expects); ``ulysses`` takes the contiguous chunk ``r``. The
positions (``position_ids``) and the globally shifted targets of an unshifted ``labels`` go with the shard,
because a model can no longer derive either from its local part of the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_llmpar.training.documents import document_ids_from_positions, packed_beyond_padding
from lightning_llmpar.training.ignore_index import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "SHIFT_IN_STEP", "SequenceShard", "positions_for", "shard_batch"]



def positions_for(seq_len: int, cp: int, rank: int, mode: str) -> Tensor:
    """This rank's token positions within a sequence of ``seq_len``, in the order the shard holds them."""
    if mode == "ring":
        chunk = seq_len // (2 * cp)
        head = torch.arange(rank * chunk, (rank + 1) * chunk)
        tail = torch.arange(seq_len - (rank + 1) * chunk, seq_len - rank * chunk)
        return torch.cat([head, tail])
    chunk = seq_len // cp
    return torch.arange(rank * chunk, (rank + 1) * chunk)


def check_sequence_length(seq_len: int, cp: int, mode: str) -> None:
    parts = 2 * cp if mode == "ring" else cp
    if seq_len % parts:
        why = "two chunks per rank for the causal load balance" if mode == "ring" else "one chunk per rank"
        raise ValueError(
            f"context_parallel={cp} with context_parallel_mode={mode!r} cuts every sequence into {parts} chunks"
            f" ({why}), but the batch's sequence length is {seq_len}. Use a sequence length divisible by {parts}"
            " (pad on the right, with ignored targets -100)."
        )


@dataclass
class SequenceShard:
    """What cutting one batch left for the model's forward: positions and the shifted targets of ``labels``."""

    seq_len: int
    positions: Tensor
    shifted: dict[int, Tensor] = field(default_factory=dict)  # id(local labels) -> local shifted labels
    targets: Tensor | None = None  # the local targets whose valid count weighs this rank's loss
    labels_seen: bool = False
    documents: Tensor | None = None  # the whole sequences' document ids, for packed rows (Ulysses)
    appended: Tensor | None = None  # where the local shifted labels hold the target appended after the last token


def _first_sequence(batch: Any) -> Tensor | None:
    if isinstance(batch, Tensor):
        return batch if batch.ndim >= 2 else None
    if isinstance(batch, dict):
        if isinstance(batch.get("input_ids"), Tensor):
            return batch["input_ids"]
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _first_sequence(item)
            if found is not None:
                return found
    return None


def _check_right_padding(mask: Tensor) -> None:
    # Ring and Ulysses attention run causal attention without a mask. Padding on the right is then exact: real
    # tokens never attend to later positions, and padded positions carry ignored targets.
    m = mask.to(torch.int64)
    if bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError(
            "context_parallel runs causal attention without an attention mask, which is exact for padding on the right"
            " only; this batch's attention_mask has padding before real tokens. Pad on the right (tokenizer"
            " padding_side='right'), or use context_parallel=1."
        )


# Sequence-shaped entries of a dict batch that are neither inputs nor targets.
_NOT_TOKENS = ("attention_mask", "position_ids", "document_ids", "seq_lens", "cu_seqlens")

SHIFT_IN_STEP = (
    "A step that shifts a sequence itself (`logits = model(x[:, :-1]); loss = cross_entropy(logits, x[:, 1:])`, or"
    " `cross_entropy(logits[:, :-1], x[:, 1:])`) cannot run on a rank's part of the sequence: the slices would drop"
    " this rank's last token instead of the sequence's, and pair tokens with other ranks' targets. Put inputs and"
    " shifted targets in the batch, cut alike: yield (x[:-1], x[1:]) pairs and compute `cross_entropy(model(inputs),"
    " targets)`; or dicts with 'input_ids' and 'labels' for a transformers model (it shifts labels itself, and"
    " context parallelism shifts them before the cut)."
)


def _check_targets(batch: Any, seq_len: int) -> None:
    """Refuse a training batch holding one token sequence and no targets: its step can only shift it itself."""
    if isinstance(batch, dict):
        items = [v for k, v in batch.items() if k not in _NOT_TOKENS]
    else:
        items = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    sequences = [x for x in items if isinstance(x, Tensor) and x.ndim >= 2 and x.shape[1] == seq_len]
    if len(sequences) < 2 and not (isinstance(batch, dict) and "labels" in batch):
        raise ValueError(
            f"context_parallel cuts every sequence of the batch before the training step, but this batch holds one"
            f" token sequence (length {seq_len}) and no targets, so the step must derive the targets from it. "
            + SHIFT_IN_STEP
        )


def _packed_beyond_padding(positions: Tensor, batch: dict[str, Any]) -> bool:
    """Restarting positions pack documents unless only pads follow (mask 0, or targets ignored)."""
    mask, labels = batch.get("attention_mask"), batch.get("labels")
    if isinstance(mask, Tensor) and mask.shape == positions.shape:
        return packed_beyond_padding(positions, mask)
    if isinstance(labels, Tensor) and labels.shape == positions.shape:
        return packed_beyond_padding(positions, labels != IGNORE_INDEX)
    return True


def _documents(batch: Any, mode: str) -> Tensor | None:
    """The whole sequences' document ids of packed rows (None: one document per row). Ulysses attends over whole
    sequences, so it masks each document; ring attention here is causal without a mask: packed rows refused."""
    if not isinstance(batch, dict):
        return None
    positions, documents = batch.get("position_ids"), batch.get("document_ids")
    packed = isinstance(documents, Tensor) and bool((documents[..., 1:] != documents[..., :-1]).any())
    if (not packed and isinstance(positions, Tensor) and positions.ndim == 2 and bool((positions[..., 1:] == 0).any())
            and _packed_beyond_padding(positions, batch)):
        packed, documents = True, document_ids_from_positions(positions)
    if packed and mode == "ring":
        given = "document_ids changing" if isinstance(batch.get("document_ids"), Tensor) else "position_ids restarting at 0"
        raise ValueError(
            f"context_parallel_mode='ring' runs causal attention over the ranks without a mask, but this batch packs"
            f" several documents in a row ({given} inside it), which would then attend across their boundaries:"
            " wrong results. Use context_parallel_mode='ulysses' (each rank attends over whole sequences with the"
            " document mask), tensor, pipeline or data parallelism, or one document per row (padded on the right)."
        )
    return documents if packed else None


def shard_batch(batch: Any, cp: int, rank: int, mode: str) -> tuple[Any, SequenceShard | None]:
    """Cut every tensor of ``batch`` whose dimension 1 is the sequence; None when the batch has no sequence."""
    first = _first_sequence(batch)
    if first is None:
        return batch, None
    seq_len = first.shape[1]
    if isinstance(batch, dict) and isinstance(batch.get("attention_mask"), Tensor):
        _check_right_padding(batch["attention_mask"])
    _check_targets(batch, seq_len)
    documents = _documents(batch, mode)
    check_sequence_length(seq_len, cp, mode)
    index = positions_for(seq_len, cp, rank, mode).to(first.device)
    shard = SequenceShard(seq_len, index.unsqueeze(0).expand(first.shape[0], -1), documents=documents)

    def cut(x: Any) -> Any:
        if isinstance(x, Tensor) and x.ndim >= 2 and x.shape[1] == seq_len:
            return x.index_select(1, index)
        return x

    if isinstance(batch, dict):
        out = {k: cut(v) for k, v in batch.items()}
        labels = batch.get("labels")
        if isinstance(labels, Tensor) and labels.ndim == 2:
            # transformers' causal-LM loss shifts labels by one inside the model; cut the shifted ones instead.
            shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
            shard.targets = shifted.index_select(1, index)
            shard.shifted[id(out["labels"])] = shard.targets
            shard.appended = index == seq_len - 1
        elif isinstance(batch.get("targets"), Tensor) and batch["targets"].shape == first.shape:
            shard.targets = out["targets"]  # already shifted, as in (inputs, targets) pairs
        return out, shard
    if isinstance(batch, (list, tuple)):
        out = type(batch)(cut(x) for x in batch) if isinstance(batch, list) else tuple(cut(x) for x in batch)
        if len(batch) >= 2 and isinstance(batch[1], Tensor) and batch[1].shape == first.shape:
            shard.targets = out[1]  # (inputs, targets) pairs carry targets already shifted
        return out, shard
    return cut(batch), shard
