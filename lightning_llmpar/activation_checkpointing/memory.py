"""Activation memory: what a forward leaves held for backward, measured and predicted.

Counting tensors seen by ``saved_tensors_hooks`` misses what checkpointing keeps: a checkpointed region
packs placeholders, keeps its inputs in a closure, and selective checkpointing caches the outputs of the
ops it saves outside those hooks. So the measurement here works on storages instead: a dispatch mode
records every storage an op creates while ``fn`` runs; after ``fn`` returns and the caller's
references are gone, the recorded storages still alive are exactly those kept by the autograd graph
or a checkpoint cache. Parameters, buffers and other storages that existed before are never recorded
(a view of them creates no storage), so only activations count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from lightning_llmpar.modeling.structure import is_transformers

__all__ = ["StorageRecorder", "block_activation_formula", "held_activation_bytes", "korthikanti_bytes"]


def _plain_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors with real storage inside ``obj`` (a DTensor or other wrapper counts its local tensors)."""
    for leaf in tree_flatten(obj)[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(leaf):
            names, _ = leaf.__tensor_flatten__()  # type: ignore[attr-defined]
            yield from _plain_tensors([getattr(leaf, n) for n in names])
        elif leaf.device.type != "meta":
            yield leaf


class StorageRecorder(TorchDispatchMode):
    """Weakly records each storage created by an op while active; ``held_bytes`` sums those still alive."""

    def __init__(self) -> None:
        super().__init__()
        # Keyed by the storage's C pointer: a freed storage's pointer can be reused by a new one, so an
        # expired entry is replaced rather than taken for the same storage.
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # An output sharing an input's storage (a view, an in-place op) allocated nothing new.
        inputs = {t.untyped_storage()._cdata for t in _plain_tensors((args, kwargs))}
        for t in _plain_tensors(out):
            self.record(t, exclude=inputs)
        return out

    def record(self, t: torch.Tensor, exclude: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        storage = t.untyped_storage()
        key = storage._cdata
        if key in exclude:
            return
        known = self._storages.get(key)
        if known is None or known[0].expired():
            self._storages[key] = (StorageWeakRef(storage), storage.nbytes())

    def held_bytes(self, exclude: Any = ()) -> int:
        """Bytes of recorded storages still alive, leaving out those of the tensors in ``exclude``."""
        skip = {t.untyped_storage()._cdata for t in _plain_tensors(exclude)}
        return sum(n for key, (ref, n) in self._storages.items() if key not in skip and not ref.expired())


def _fresh(arg: Any) -> Any:
    # The activation flowing in (a tensor that requires grad) gets a private copy, so whether the graph
    # keeps it can be seen; tables and masks shared by every block are passed through unchanged. A transformers KV
    # cache is left out: each call appends its keys and values to it, and the real call after the measuring one
    # attended over both (an empty cache, as a training forward has, computes the same as none).
    if isinstance(arg, torch.Tensor) and arg.requires_grad:
        return arg.detach().clone().requires_grad_(True)
    if is_transformers(arg, "Cache"):
        return None
    return arg


@contextmanager
def _forked_rng(args: Any) -> Iterator[None]:
    devices = sorted({t.device.index or 0 for t in _plain_tensors(args) if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        yield


def held_activation_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Bytes that ``fn(*args, **kwargs)`` leaves held for backward.

    Tensor arguments that require grad are copied first, so a kept input counts (as it does in the
    formula of a transformer layer); the outputs do not count (their consumer keeps them, or not). The
    RNG state is restored afterwards and the graph is dropped: calling this changes nothing.
    """
    recorder = StorageRecorder()
    with _forked_rng((args, kwargs)), torch.enable_grad():
        fresh_args = [_fresh(a) for a in args]
        fresh_kwargs = {k: _fresh(v) for k, v in kwargs.items()}
        for old, new in zip([*args, *kwargs.values()], [*fresh_args, *fresh_kwargs.values()]):
            if new is not old:
                for t in _plain_tensors(new):
                    recorder.record(t)
        with recorder:
            out = fn(*fresh_args, **fresh_kwargs)
        del fresh_args, fresh_kwargs
        held = recorder.held_bytes(exclude=out)
    del out
    return held


def korthikanti_bytes(seq: int, batch: int, hidden: int, heads: int) -> int:
    """Activation bytes of one transformer layer, Korthikanti et al. (2022), eq. 1: 16-bit activations,
    dropout masks, attention scores materialized: ``s*b*h*(34 + 5*a*s/h)``."""
    return int(seq * batch * hidden * (34 + 5 * heads * seq / hidden))


def block_activation_formula(
    seq: int, batch: int, hidden: int, heads: int, mlp_hidden: int, bytes_per_element: int = 4
) -> dict[str, int]:
    """Bytes one block of the example GPT keeps for backward, term by term (Korthikanti's count redone
    for this block: no dropout, SDPA flash attention (no s*s scores), RMSNorm, SwiGLU, GQA, RoPE).

    With s*b tokens, h = hidden, a = heads, f = mlp_hidden, in elements:

    - ``attn_norm``: 3sbh + sb. ``pow`` keeps the block input, the weight multiply keeps both the
      normalized tensor and (as the projections' input) its product with the weight; the scale keeps
      its rsqrt (one value per token).
    - ``qkv``: 3sbh. The projections' outputs are not kept (RoPE multiplies them by constant tables,
      which keeps only the tables); what the attention kernel keeps is the rotated q and k and v repeated
      to all a heads: the model repeats k/v before SDPA, so GQA saves no activation memory here.
    - ``attention``: 2sbh + sba. The kernel's output and its log-sum-exp (one value per token and
      head; flash attention keeps no s*s scores), and the output projection's input, a copy of the
      output made contiguous in (token, head) order.
    - ``mlp_norm``: 3sbh + sb, as ``attn_norm``, on the residual stream after attention.
    - ``swiglu``: 4sbf. gate output (kept by SiLU), SiLU output and up output (kept by the product),
      the product (kept by the down projection).

    The residual adds keep nothing; the block's output is counted by the next block, which keeps it.
    Korthikanti's 16-bit layer with dropout is 34sbh + 5as^2b bytes; this block in 4-byte elements is
    4 * sb * (11h + 4f + a + 2) bytes.
    """
    sb = seq * batch
    terms = {
        "attn_norm": 3 * sb * hidden + sb,
        "qkv": 3 * sb * hidden,
        "attention": 2 * sb * hidden + sb * heads,
        "mlp_norm": 3 * sb * hidden + sb,
        "swiglu": 4 * sb * mlp_hidden,
    }
    out = {k: v * bytes_per_element for k, v in terms.items()}
    out["total"] = sum(out.values())
    return out
