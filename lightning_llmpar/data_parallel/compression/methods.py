"""Gradient compressors for the data-parallel gradient sync: the tensor math and the state it keeps.

Every compressor turns this rank's gradient into the data-parallel mean through a small
:class:`Comm` (``all_gather`` / ``all_to_all`` / ``all_reduce_sum`` over the data-parallel group).
Keeping the collectives behind that interface lets the math run, and be tested, on one process
(:class:`LocalComm`) exactly as it runs on many. FSDP2 wiring lives in ``compression_hooks.py``.

- ``fp16`` / ``bf16``: 16-bit payloads, summed in fp32 (2x fewer bytes).
- ``int8``: symmetric 8-bit quantization with one fp32 scale per ``chunk_size`` values (~4x).
- ``topk``: the ``fraction`` largest-magnitude entries (values + int32 indices) with error feedback,
  optionally after ``start_step`` uncompressed syncs.
- ``powersgd``: rank-``rank`` factors P, Q of every weight matrix (Vogels et al., 2019), warm-started
  Q, error feedback, and an uncompressed sync before ``start_step``; vectors (norms, biases) go
  uncompressed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = [
    "METHODS",
    "STAGE_SUPPORT",
    "Comm",
    "CompressionConfig",
    "CompressionStats",
    "Compressor",
    "LocalComm",
    "dequantize_int8",
    "make_compressor",
    "orthonormalize",
    "quantize_int8",
    "topk_select",
]

METHODS = ("fp16", "bf16", "int8", "topk", "powersgd")
# Which compressors each ZeRO stage runs. Stages 0 and 1 reduce through a (compressed) all-reduce of the
# whole gradient; stages 2 and 3 exist to never hold a full gradient or a full-size residual on a rank,
# and only element-wise codes can be reduce-scattered (each rank sums its own chunk of everyone's codes).
_ELEMENTWISE = ("fp16", "bf16", "int8")
STAGE_SUPPORT: dict[int, tuple[str, ...]] = {0: METHODS, 1: METHODS, 2: _ELEMENTWISE, 3: _ELEMENTWISE}
_OPTIONS: dict[str, tuple[str, ...]] = {
    "fp16": (), "bf16": (), "int8": ("chunk_size",), "topk": ("fraction", "start_step"),
    "powersgd": ("rank", "start_step", "warm_start", "min_compression"),
}


@dataclass(frozen=True)
class CompressionConfig:
    """A validated ``gradient_compression`` value: a method name or ``{"method": ..., **options}``."""

    method: str
    chunk_size: int = 1024
    fraction: float = 0.01
    rank: int = 4
    start_step: int | None = None  # None: 10 for powersgd, 0 for topk
    warm_start: bool = True
    min_compression: float = 2.0  # PowerSGD skips a matrix unless its factors are this many times smaller

    def __post_init__(self) -> None:
        if self.start_step is None:  # frozen: the method's default is filled in once, here
            object.__setattr__(self, "start_step", 10 if self.method == "powersgd" else 0)

    @classmethod
    def from_user(cls, value: str | dict[str, Any]) -> CompressionConfig:
        options = {"method": value} if isinstance(value, str) else dict(value) if isinstance(value, dict) else None
        if options is not None and "method" not in options:
            raise ValueError(
                f"gradient_compression={value!r} names no method: add 'method', one of {METHODS} (e.g."
                " {'method': 'powersgd', 'rank': 4})."
            )
        if options is None or options["method"] not in METHODS:
            got = options["method"] if options else value
            raise ValueError(
                f"gradient_compression={got!r} is not a known method: use one of {METHODS}, or a dict such as"
                " {'method': 'topk', 'fraction': 0.01}."
            )
        method = options.pop("method")
        unknown = sorted(set(options) - set(_OPTIONS[method]))
        if unknown:
            raise ValueError(
                f"gradient_compression: {unknown} are not options of method={method!r};"
                f" it takes {list(_OPTIONS[method]) or 'no options'}."
            )
        config = cls(method=method, **options)
        config._check()
        return config

    def _check(self) -> None:
        def bad(name: str, need: str) -> ValueError:
            return ValueError(f"gradient_compression: {name}={getattr(self, name)!r} must be {need}.")

        if not isinstance(self.fraction, (int, float)) or not 0 < self.fraction <= 1:
            raise bad("fraction", "in (0, 1] (the share of gradient entries top-k sends, e.g. 0.01)")
        for name in ("rank", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, "a positive integer")
        if isinstance(self.start_step, bool) or not isinstance(self.start_step, int) or self.start_step < 0:
            raise bad("start_step", "an integer >= 0 (optimizer steps synced uncompressed before compression starts)")
        if not isinstance(self.warm_start, bool):
            raise bad("warm_start", "True or False")
        if not isinstance(self.min_compression, (int, float)) or self.min_compression < 1:
            raise bad("min_compression", ">= 1")

    def __str__(self) -> str:
        options = ", ".join(f"{name}={getattr(self, name)!r}" for name in _OPTIONS[self.method])
        return f"{self.method}({options})"

    def check_layout(self, zero_stage: int, hybrid: bool) -> None:
        """Refuse a stage this method cannot compress, naming what works where."""
        if self.method not in STAGE_SUPPORT[zero_stage]:
            table = "; ".join(f"zero_stage={s}: {', '.join(m)}" for s, m in STAGE_SUPPORT.items())
            raise ValueError(
                f"gradient_compression={self.method!r} cannot run with zero_stage={zero_stage}: it needs the whole"
                f" gradient and a full-size residual on every rank, which zero_stage 2/3 shard away. Supported:"
                f" {table}. Use zero_stage 0 or 1, or an element-wise method (fp16, bf16, int8)."
            )
        if hybrid:
            raise ValueError(
                "gradient_compression does not support hybrid sharding (data_parallel_replicate > 1 with"
                " zero_stage >= 1): set data_parallel_replicate=1 (or 'auto'), or use zero_stage=0."
            )


class Comm(Protocol):
    """The collectives a compressor needs over the data-parallel group (SUM semantics, no averaging)."""

    size: int
    rank: int

    def all_gather(self, tensor: Tensor) -> Tensor: ...  # [size, *tensor.shape]
    def all_to_all(self, tensor: Tensor) -> Tensor: ...  # row r of a [size, n] input goes to rank r
    def all_reduce_sum(self, tensor: Tensor) -> None: ...


class LocalComm:
    """One rank: the identity collectives, for tests and for a data-parallel degree of 1."""

    size, rank = 1, 0

    def all_gather(self, tensor: Tensor) -> Tensor:
        return tensor.unsqueeze(0).clone()

    def all_to_all(self, tensor: Tensor) -> Tensor:
        return tensor.clone()

    def all_reduce_sum(self, tensor: Tensor) -> None:
        pass


@dataclass
class CompressionStats:
    """Bytes this rank handed to data-parallel collectives since the last ``reset``, raw (fp32) vs sent."""

    raw_bytes: int = 0
    sent_bytes: int = 0
    # Latest squared residual norm per unit, as 0-d tensors: turning them into floats here would make the
    # device wait inside backward; they are read once per step instead.
    residuals: dict[str, Tensor] = field(default_factory=dict)

    def add(self, raw: int, sent: int) -> None:
        self.raw_bytes += raw
        self.sent_bytes += sent

    def reset(self) -> None:
        self.raw_bytes = self.sent_bytes = 0


# ----------------------------------------------------------------------------- element-wise codes


def _even_chunk(numel: int, chunk_size: int) -> int:
    # As many chunks as chunk_size asks for, but of equal length, so padding stays below one per chunk.
    return max(1, math.ceil(numel / max(1, math.ceil(numel / chunk_size))))


def quantize_int8(x: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Symmetric int8 codes and one scale (absmax / 127) per chunk; the last chunk is zero-padded."""
    flat = x.reshape(-1).float()
    chunk_size = _even_chunk(flat.numel(), chunk_size)
    pad = (-flat.numel()) % chunk_size
    chunks = torch.nn.functional.pad(flat, (0, pad)).view(-1, chunk_size)
    scales = chunks.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127.0
    codes = torch.round(chunks / scales).clamp_(-127, 127).to(torch.int8)
    return codes, scales.squeeze(1)


def dequantize_int8(codes: Tensor, scales: Tensor, numel: int) -> Tensor:
    return (codes.float() * scales.unsqueeze(-1)).reshape(-1)[:numel]


def _encode(x: Tensor, method: str, chunk_size: int) -> Tensor:
    """One row's payload as a flat byte tensor, so one collective carries codes and scales together."""
    if method in ("fp16", "bf16"):
        half = x.to(torch.float16 if method == "fp16" else torch.bfloat16)
        # gloo cannot reduce or even gather bf16 everywhere: ship the raw 16-bit patterns as bytes.
        payload = half.view(torch.uint8)
    else:
        codes, scales = quantize_int8(x, chunk_size)
        payload = torch.cat([codes.view(torch.uint8).reshape(-1), scales.view(torch.uint8)])
    return payload


def _decode(payload: Tensor, method: str, numel: int, chunk_size: int) -> Tensor:
    if method in ("fp16", "bf16"):
        return payload.view(torch.float16 if method == "fp16" else torch.bfloat16).float()
    chunk_size = _even_chunk(numel, chunk_size)
    n_chunks = math.ceil(numel / chunk_size)
    codes = payload[: n_chunks * chunk_size].view(torch.int8).view(n_chunks, chunk_size)
    scales = payload[n_chunks * chunk_size :].clone().view(torch.float32)  # the copy realigns to 4 bytes
    return dequantize_int8(codes, scales, numel)


# ----------------------------------------------------------------------------- top-k and PowerSGD math


def topk_select(x: Tensor, fraction: float) -> tuple[Tensor, Tensor]:
    """Indices (int32) and values of the ``ceil(fraction * numel)`` largest-magnitude entries of flat ``x``."""
    k = max(1, math.ceil(fraction * x.numel()))
    if k >= x.numel():
        return torch.arange(x.numel(), dtype=torch.int32, device=x.device), x.clone()
    idx = x.abs().topk(k, sorted=False).indices
    return idx.to(torch.int32), x[idx]


def orthonormalize(m: Tensor) -> Tensor:
    """Orthonormal columns spanning ``m`` (reduced QR; a zero column stays harmless)."""
    return torch.linalg.qr(m, mode="reduced").Q


# ----------------------------------------------------------------------------- stateful compressors


class Compressor:
    """Reduces one FSDP unit's flat gradient to the data-parallel mean; owns that unit's state.

    ``reduce(x, shapes, comm)`` takes this rank's flat fp32 gradient ``x`` (its parameters laid out as
    ``shapes`` matrices, in order) and returns the mean over ranks as this compressor approximates it.
    """

    def __init__(self, config: CompressionConfig, stats: CompressionStats, name: str) -> None:
        self.config, self.stats, self.name = config, stats, name
        self.residual: Tensor | None = None
        self.step = 0

    def reduce(self, x: Tensor, shapes: list[tuple[int, int]], comm: Comm) -> Tensor:
        raise NotImplementedError

    def reduce_scatter(self, rows: Tensor, comm: Comm) -> Tensor:
        """Sum over ranks of row ``comm.rank`` of ``rows`` ([size, n]), for element-wise codes only."""
        raise NotImplementedError(f"{self.config.method} cannot be reduce-scattered")

    def _dense_until_start(self, x: Tensor, comm: Comm) -> Tensor | None:
        """The plain fp32 mean while ``step <= start_step`` (counted in syncs), else None."""
        self.step += 1
        if self.step > (self.config.start_step or 0):
            return None
        out = x.clone()
        comm.all_reduce_sum(out)
        self.stats.add(x.numel() * 4, x.numel() * 4)
        return out / comm.size

    def _note_residual(self) -> None:
        if self.residual is not None:
            self.stats.residuals[self.name] = self.residual.double().square().sum()

    def state_dict(self) -> dict[str, Any]:
        return {"residual": self.residual, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residual, self.step = state["residual"], state["step"]
        self._note_residual()


class ElementwiseCompressor(Compressor):
    """fp16 / bf16 / int8: all-reduce as a compressed reduce-scatter then a compressed all-gather."""

    def reduce_scatter(self, rows: Tensor, comm: Comm) -> Tensor:
        method, chunk = self.config.method, self.config.chunk_size
        n = rows.shape[1]
        payloads = [_encode(row, method, chunk) for row in rows]
        received = comm.all_to_all(torch.stack(payloads))
        self.stats.add(rows.numel() * 4, received.numel())
        total = torch.zeros(n, dtype=torch.float32, device=rows.device)
        for payload in received:  # in rank order, so every rank sums its chunk identically
            total += _decode(payload, method, n, chunk)
        return total

    def reduce(self, x: Tensor, shapes: list[tuple[int, int]], comm: Comm) -> Tensor:
        numel, size = x.numel(), comm.size
        rows = torch.nn.functional.pad(x, (0, (-numel) % size)).view(size, -1)
        mine = self.reduce_scatter(rows, comm) / size
        payload = _encode(mine, self.config.method, self.config.chunk_size)
        # Bytes count the gradient's payload once (its reduce-scatter half), as for every method.
        gathered = comm.all_gather(payload)
        n = rows.shape[1]
        return torch.cat([_decode(p, self.config.method, n, self.config.chunk_size) for p in gathered])[:numel]


class TopKCompressor(Compressor):
    """Top-k with error feedback: what is not sent this step is added to the next step's gradient."""

    def reduce(self, x: Tensor, shapes: list[tuple[int, int]], comm: Comm) -> Tensor:
        if (dense := self._dense_until_start(x, comm)) is not None:
            return dense
        acc = x if self.residual is None else x + self.residual
        idx, values = topk_select(acc, self.config.fraction)
        self.residual = acc.clone()
        self.residual[idx.long()] = 0
        self._note_residual()
        indices, gathered = comm.all_gather(idx), comm.all_gather(values)
        self.stats.add(x.numel() * 4, idx.numel() * 4 + values.numel() * values.element_size())
        out = torch.zeros_like(x)
        for i, v in zip(indices, gathered):  # rank order: 0 + g0 + g1 + ..., as a sum all-reduce adds
            out.index_add_(0, i.long(), v)
        return out / comm.size


class PowerSGDCompressor(Compressor):
    """Rank-r PowerSGD per weight matrix; uncompressed until ``start_step`` syncs have happened."""

    def __init__(self, config: CompressionConfig, stats: CompressionStats, name: str) -> None:
        super().__init__(config, stats, name)
        self.qs: list[Tensor] | None = None

    def _compressible(self, shape: tuple[int, int]) -> bool:
        n, m = shape
        return min(n, m) > 1 and n * m >= self.config.min_compression * (n + m) * self.config.rank

    def reduce(self, x: Tensor, shapes: list[tuple[int, int]], comm: Comm) -> Tensor:
        if (dense := self._dense_until_start(x, comm)) is not None:
            return dense
        raw = x.numel() * 4
        acc = x if self.residual is None else x + self.residual
        sizes = [n * m for n, m in shapes]
        mats = list(torch.split(acc, sizes))
        big = [i for i, s in enumerate(shapes) if self._compressible(s)]
        small = [i for i in range(len(shapes)) if i not in set(big)]
        if self.qs is None or not self.config.warm_start or len(self.qs) != len(big):
            # The same seed on every rank: the first P = M Q must use one Q everywhere.
            gen = torch.Generator().manual_seed(1000 + self.step * int(not self.config.warm_start))
            self.qs = [torch.randn(shapes[i][1], min(self.config.rank, *shapes[i]), generator=gen).to(x) for i in big]
        ps = [mats[i].view(shapes[i]) @ q for i, q in zip(big, self.qs)]
        # One all-reduce carries every P plus the vectors (sent exactly); a second carries every Q.
        first = torch.cat([p.reshape(-1) for p in ps] + [mats[i] for i in small] + [x.new_zeros(0)])
        comm.all_reduce_sum(first)
        p_numel = sum(p.numel() for p in ps)
        ps = [orthonormalize(p) for p in _unflatten(first[:p_numel], [p.shape for p in ps])]
        qs = [mats[i].view(shapes[i]).t() @ p for i, p in zip(big, ps)]
        second = torch.cat([q.reshape(-1) for q in qs] + [x.new_zeros(0)])
        comm.all_reduce_sum(second)
        self.qs = [q / comm.size for q in _unflatten(second, [q.shape for q in qs])]
        self.stats.add(raw, (first.numel() + second.numel()) * 4)
        parts: list[Tensor] = [x.new_zeros(0)] * len(shapes)
        for i, p, q in zip(big, ps, self.qs):
            parts[i] = (p @ q.t()).reshape(-1)
        for i, mean in zip(small, torch.split(first[p_numel:] / comm.size, [sizes[i] for i in small])):
            parts[i] = mean
        out = torch.cat(parts) if parts else x.clone()
        self.residual = acc - out
        for i, r in enumerate(torch.split(self.residual, sizes)):
            if i in small:
                r.zero_()  # vectors went exactly: the mean replacing this rank's own value is no error
        self._note_residual()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "qs": self.qs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.qs = state["qs"]


def _unflatten(flat: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def make_compressor(config: CompressionConfig, stats: CompressionStats, name: str) -> Compressor:
    kind = {"topk": TopKCompressor, "powersgd": PowerSGDCompressor}.get(config.method, ElementwiseCompressor)
    return kind(config, stats, name)
