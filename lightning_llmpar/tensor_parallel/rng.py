"""Dropout under tensor parallelism, Megatron-style: one random stream where activations are replicated over
the tensor-parallel ranks, a stream per rank where each holds different data (its heads, features or tokens);
and a stream per pipeline rank, whose blocks are different layers (``separate_stage_streams``).

Replicated activations must be dropped identically on every rank (they are the same tensor); sharded ones must
not (identical masks on different heads would correlate them). A region runs on a seed drawn from the shared
stream and mixed with the rank, from its entry until its row-split projection starts (what follows it, such as
GPT-2's residual dropout inside the attention module, is replicated or token-sharded again); then the shared
stream continues as if the region drew one number. Drawing from the shared stream makes the region's seed part
of the state activation checkpointing saves, so recomputation drops exactly what the forward dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["apply_rank_streams", "separate_stage_streams"]

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: seeds of neighbouring ranks are far apart


def _seed(seed: int) -> None:
    # Seed the two generators dropout draws from, not ``torch.manual_seed``: that also queues a seed for every
    # other device type, and each queued call formats the Python stack (a few ms, a dozen times a step).
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(seed)  # the current device; runs at once on an initialized CUDA


def _state() -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None


def _restore(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


class _RankStream:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.windows: list[list[int]] = []  # per window in progress: [its shared draw, replicated dropouts run]
        self.outer: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def enter(self, key: int, training: bool) -> None:
        if not training or key in self.saved:
            return
        seed = int(torch.randint(0, 2**62, (), device="cpu"))  # the shared stream moves on by one draw
        self.saved[key] = _state()
        self.windows.append([seed, 0])
        _seed((seed + self.rank * _MIX) % 2**63)

    def leave(self, key: int) -> None:
        state = self.saved.pop(key, None)
        if state is None:
            return
        self.windows.pop()
        _restore(state)

    def replicated_enter(self, training: bool) -> None:
        """A dropout on replicated activations inside a window (a LoRA adapter's on a column split's input): the
        same mask on every rank, from the window's shared draw and how many such dropouts ran in it before."""
        self.outer.append(_state())
        if training and self.windows:
            window = self.windows[-1]
            window[1] += 1
            _seed((window[0] + window[1] * _MIX) % 2**63)

    def replicated_leave(self) -> None:
        if self.outer:
            _restore(self.outer.pop())


def apply_rank_streams(
    model: nn.Module, regions: Mapping[str, Sequence[str]], tp_rank: int, replicated: Sequence[str] = ()
) -> None:
    """``regions``: module name -> the row-split projections that end its per-rank part (none: the whole module);
    ``replicated``: dropout modules inside such a part that see replicated activations."""
    stream = _RankStream(tp_rank)
    for name in replicated:
        dropout = model.get_submodule(name)
        dropout.register_forward_pre_hook(lambda mod, args: stream.replicated_enter(mod.training))
        dropout.register_forward_hook(lambda *_: stream.replicated_leave(), always_call=True)
    for name, rows in regions.items():
        module = model.get_submodule(name)
        key = id(module)

        def enter(mod: nn.Module, args: Any, __key: int = key) -> None:
            stream.enter(__key, mod.training)

        def leave(*_: Any, __key: int = key) -> None:
            stream.leave(__key)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        for row in rows:
            model.get_submodule(row).register_forward_pre_hook(leave)


def separate_stage_streams(pp_rank: int) -> None:
    """Put this pipeline rank on its own random stream before training. Every rank starts from the seed
    ``seed_everything`` gave all of them, so block k on the first stage and block k + n/pp on the next drew the
    same dropout mask for each microbatch, where one process draws independent ones (Megatron offsets its seed by
    the pipeline rank). Ranks after the first draw one number from the shared stream and mix their pipeline rank
    into it; the ranks of one stage (tensor, context and data parallel) stay on one stream, as each expects."""
    if pp_rank:
        seed = int(torch.randint(0, 2**62, (), device="cpu"))
        _seed((seed + pp_rank * _MIX) % 2**63)
