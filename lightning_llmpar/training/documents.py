"""Packed documents: several documents in one row, attention kept inside each.

Boundaries come as ``position_ids`` restarting at 0 at each document (Hugging Face's padding-free convention, its
``DataCollatorWithFlattening``) or as ``document_ids`` (one id per token, equal within a document). A packed row then
trains exactly as its documents would one per row with padding, provided attention is block-diagonal causal.

- The example GPT builds that mask itself (``document_causal_mask``).
- transformers models build it from ``position_ids`` only without a key/value cache (masking_utils'
  ``find_packed_sequence_indices``); with the cache their config asks for (``use_cache=True``, the default) a packed
  row attends across its documents. ``apply_document_masking`` makes training forwards of transformers models run
  without one when they are given ``position_ids`` and no ``attention_mask``: a cache has no use in a training step.
  Evaluation forwards too, unless the step asks for a cache or passes a mask itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmpar.modeling.structure import is_transformers

__all__ = ["apply_document_masking", "document_causal_mask", "document_ids_from_positions", "is_packed",
           "hook_models_with_cache", "packed_beyond_padding", "positions_from_documents", "refuse_packed_padding"]


def document_ids_from_positions(position_ids: Tensor) -> Tensor:
    """One id per token, a new one wherever the position restarts at 0. (Only a restart counts: a context-parallel
    rank's positions jump between its two chunks of the sequence without starting a document.)"""
    return (position_ids == 0).long().cumsum(-1)


def positions_from_documents(document_ids: Tensor) -> Tensor:
    """Each token's position within its document."""
    index = torch.arange(document_ids.shape[-1], device=document_ids.device).expand_as(document_ids)
    first = torch.ones_like(document_ids[..., :1], dtype=torch.bool)
    starts = torch.cat([first, document_ids[..., 1:] != document_ids[..., :-1]], dim=-1)
    return index - torch.where(starts, index, 0).cummax(-1).values


def is_packed(position_ids: Tensor | None = None, document_ids: Tensor | None = None) -> bool:
    """Whether a row holds more than one document."""
    if document_ids is not None:
        return bool((document_ids[..., 1:] != document_ids[..., :-1]).any())
    if position_ids is None or position_ids.shape[-1] < 2:
        return False
    return bool((position_ids[..., 1:] == 0).any())


def packed_beyond_padding(position_ids: Tensor, real: Tensor) -> bool:
    """Whether a row's positions restart at 0 with a real token (``real``: attention mask, or targets not ignored)
    at or after the restart: documents packed. Not when only pads follow (one document, right-padded, the pads'
    positions counted from 0 again, as some collators write them): causal attention keeps its tokens from the
    pads, and nothing there is scored."""
    restarts = torch.cat([torch.zeros_like(position_ids[..., :1], dtype=torch.bool), position_ids[..., 1:] == 0], -1)
    return bool(((restarts.int().cumsum(-1) > 0) & real.bool()).any())


def document_causal_mask(document_ids: Tensor) -> Tensor:
    """Boolean (B, 1, T, T) mask, True where query i may attend key j: j <= i within i's document."""
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    length = document_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(-3)


def apply_document_masking(module: nn.Module) -> int:
    """Training forwards of the transformers models in ``module`` given ``position_ids`` run without a key/value
    cache, so transformers masks each packed document off the others; an all-ones ``attention_mask`` beside packed
    positions is left out (with it transformers would not look for documents), one with padding refused. Returns how
    many models got the hook."""

    def hook(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        positions, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
        if positions is None or kwargs.get("past_key_values") is not None:
            return None
        if not model.training:  # evaluation: packed rows masked alike, unless the step asks for a cache or a mask
            return None if mask is not None or "use_cache" in kwargs else (args, {**kwargs, "use_cache": False})
        if mask is not None:
            if not (isinstance(mask, Tensor) and mask.dim() == 2 and packed_beyond_padding(positions, mask)):
                return None
            refuse_packed_padding(positions, mask)
            kwargs = {k: v for k, v in kwargs.items() if k != "attention_mask"}  # all ones: it says nothing
        return args, {**kwargs, "use_cache": False}

    return hook_models_with_cache(module, hook, "_llmpar_document_masking")


def refuse_packed_padding(positions: Any, mask: Any) -> None:
    """Refuse rows that pack documents and pad too. The strategy asks it of each whole training batch before the
    step, so every rank decides alike: a context-parallel rank's forward sees only its part of each row."""
    if not (isinstance(positions, Tensor) and isinstance(mask, Tensor) and mask.dim() == 2):
        return
    if packed_beyond_padding(positions, mask) and not bool(mask.all()):
        raise ValueError(
            "This batch packs several documents in a row (position_ids restarting at 0 inside it) and pads"
            " too (attention_mask has zeros); transformers masks packed documents only without an"
            " attention_mask, so they would attend across their boundaries. Pack without padding (labels -100"
            " where ignored) and leave attention_mask out, or pad one document per row."
        )


def hook_models_with_cache(module: nn.Module, hook: Any, flag: str) -> int:
    """Register ``hook`` (a forward pre-hook with kwargs) once, whatever the number of set-ups (``flag`` marks it), on
    the transformers models in ``module`` whose forward takes ``use_cache``; returns how many there are."""
    models = [sub for sub in module.modules()
              if is_transformers(sub, "PreTrainedModel") and "use_cache" in _forward_parameters(sub)]
    for model in models:
        if not getattr(model, flag, False):
            model.register_forward_pre_hook(hook, with_kwargs=True)
            setattr(model, flag, True)
    return len(models)


def _forward_parameters(module: nn.Module) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()
