"""Gradient compression wired into FSDP2's per-unit gradient reduction, on the data-parallel axis only.

FSDP2 reduces each unit (a transformer block, or a pipeline stage, then the root) from its
post-backward hook as soon as that unit's gradients exist, on its own communication stream; the
compressed collectives run in that same place, so they are launched bucket by bucket during backward
exactly like the uncompressed ones. Tensor- and pipeline-parallel traffic never passes through here.

- zero_stage 0: parameters are placed on the size-1 ``dp_shard`` axis (FSDP2 then communicates nothing)
  and an all-reduce hook turns each unit's full local gradient into the compressed data-parallel mean.
  (On the usual (dp, 1) replicate mesh FSDP2 would run its own all-reduce before any hook, and
  ``set_requires_all_reduce(False)`` skips the hook as well.)
- zero_stage >= 1: a custom reduce-scatter. fp16/bf16/int8 codes go through one all-to-all and each rank
  sums its own chunk; top-k and PowerSGD (zero_stage 1 only) reduce the whole unit gradient and keep
  this rank's shard.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from lightning_llmpar.checkpointing.safe_read import safe_torch_load
from lightning_llmpar.data_parallel.compression.methods import (
    CompressionConfig,
    CompressionStats,
    Compressor,
    make_compressor,
)
from lightning_llmpar.layout import ParallelLayout

__all__ = ["GradientCompression", "GroupComm", "apply_gradient_compression"]


class GroupComm:
    """:class:`~lightning_llmpar.data_parallel.compression.methods.Comm` over a torch.distributed process group (gloo or NCCL)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_gather(self, tensor: Tensor) -> Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts)

    def all_to_all(self, tensor: Tensor) -> Tensor:
        out = torch.empty_like(tensor)
        dist.all_to_all_single(out, tensor.contiguous(), group=self.group)
        return out

    def all_reduce_sum(self, tensor: Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)


def _matrix_shapes(module: FSDPModule, shard_world: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Each trainable parameter's (padded) gradient as a matrix, and its column count in the [shard_world, n]
    buffer. FSDP2 reduces the parameters that have a gradient: frozen ones are not in the buffer. Read at every
    reduction, so a parameter frozen or unfrozen between steps is followed (``_check_layout``)."""
    group = module._get_fsdp_state()._fsdp_param_groups[0]
    shapes, columns = [], []
    for p in group.fsdp_params:
        if not p.sharded_param.requires_grad:
            continue
        size = p.padded_sharded_param_size
        rows = size[0] * shard_world if len(size) else shard_world
        numel = math.prod(size) * shard_world
        shapes.append((rows, numel // rows if rows else 0))
        columns.append(math.prod(size))
    return shapes, columns


def _is_avg(op: Any) -> bool:
    if op == dist.ReduceOp.SUM:
        return False
    if op == dist.ReduceOp.AVG:
        return True
    raise ValueError(f"gradient compression expects FSDP2 to reduce with SUM or AVG, got {op!r}")


class CompressedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter for one unit, with this unit's compressor."""

    def __init__(self, compressor: Compressor, module: FSDPModule, shard_world: int) -> None:
        self.compressor, self.module, self.shard_world = compressor, module, shard_world
        self.comms: dict[Any, GroupComm] = {}

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: Any,
                 async_op: bool = False) -> None:
        comm = self.comms.setdefault(group, GroupComm(group))
        rows = input_tensor.view(comm.size, -1).float()
        if self.compressor.config.method in ("fp16", "bf16", "int8"):
            mine = self.compressor.reduce_scatter(rows, comm)
            output_tensor.copy_(mine / comm.size if _is_avg(op) else mine)
            return
        shapes, columns = _matrix_shapes(self.module, self.shard_world)
        _check_layout(self.compressor, sum(columns) * comm.size, rows.numel())
        # Column block i of the [world, n] buffer holds parameter i's dim-0 chunks in rank order: as a
        # flat tensor it is parameter i's whole (padded) gradient.
        pieces = torch.split(rows, columns, dim=1)
        mean = self.compressor.reduce(torch.cat([p.reshape(-1) for p in pieces]), shapes, comm)
        per_param = torch.split(mean, [c * comm.size for c in columns])
        mine = torch.cat([m.view(comm.size, -1)[comm.rank] for m in per_param])
        output_tensor.copy_(mine if _is_avg(op) else mine * comm.size)


class GradientCompression:
    """The compressors of every FSDP unit on this rank, their byte counts, and their checkpointed state."""

    def __init__(self, config: CompressionConfig, layout: ParallelLayout, device: torch.device) -> None:
        self.config, self.layout, self.device = config, layout, device
        self.stats = CompressionStats()
        self.compressors: dict[str, Compressor] = {}

    def add(self, name: str) -> Compressor:
        self.compressors[name] = make_compressor(self.config, self.stats, name)
        return self.compressors[name]

    @property
    def signature(self) -> str:
        return f"{self.config} on {self.layout}"

    def step_metrics(self) -> dict[str, float]:
        """Bytes and residual norm of this step, summed over all ranks (one small all-reduce)."""
        residual_sq = sum(float(r) for r in self.stats.residuals.values())
        totals = torch.tensor([self.stats.raw_bytes, self.stats.sent_bytes, residual_sq], dtype=torch.float64,
                              device=self.device)  # NCCL reduces device tensors only
        if dist.is_initialized():
            dist.all_reduce(totals)
        self.stats.reset()
        raw, sent, res = totals.tolist()
        return {"compression/raw_bytes": raw, "compression/sent_bytes": sent,
                "compression/ratio": raw / sent if sent else 1.0, "compression/residual_norm": math.sqrt(res)}

    def save(self, folder: Path, rank: int) -> None:
        state = {name: c.state_dict() for name, c in self.compressors.items()}
        torch.save({"signature": self.signature, "units": state}, folder / f"compression_rank{rank}.pt")

    def load(self, folder: Path, rank: int, device: torch.device) -> None:
        path = folder / f"compression_rank{rank}.pt"
        # Plain data only: a pickled payload in a checkpoint folder must not run (ValueError instead).
        saved = safe_torch_load(path, map_location=device) if path.is_file() else None
        if saved is None or saved["signature"] != self.signature or saved["units"].keys() != self.compressors.keys():
            found = "no compressor state" if saved is None else f"state for {saved['signature']}"
            warnings.warn(
                f"Checkpoint {folder} holds {found}; this run is {self.signature}. Error-feedback residuals and"
                " PowerSGD factors start from zero.", stacklevel=2,
            )
            return
        for name, state in saved["units"].items():
            self.compressors[name].load_state_dict(state)


def apply_gradient_compression(
    fsdp_roots: list[nn.Module], mesh: DeviceMesh, layout: ParallelLayout, config: CompressionConfig
) -> GradientCompression | None:
    """Give every FSDP unit under ``fsdp_roots`` a compressor on the data-parallel axis of ``mesh``.

    Returns None when there is no data-parallel axis (dp=1): no gradient sync, nothing to compress.
    """
    config.check_layout(layout.zero_stage, hybrid=layout.zero_stage > 0 and layout.dp_replicate > 1)
    if layout.dp == 1:
        return None
    handle = GradientCompression(config, layout, torch.device(mesh.device_type))
    dp_comm = GroupComm(mesh["dp_replicate"].get_group()) if layout.zero_stage == 0 else None
    units: set[int] = set()  # blocks grouped into one unit share its state: one compressor per unit
    for index, root in enumerate(fsdp_roots):
        for name, module in root.named_modules():
            if not isinstance(module, FSDPModule) or not module._get_fsdp_state()._fsdp_param_groups:
                continue
            if id(module._get_fsdp_state()) in units:
                continue
            units.add(id(module._get_fsdp_state()))
            compressor = handle.add(f"{index}:{name}")
            if dp_comm is None:
                module.set_custom_reduce_scatter(CompressedReduceScatter(compressor, module, layout.dp_shard))
            else:
                module.set_all_reduce_hook(_all_reduce_hook(compressor, module, dp_comm))
    return handle


def _all_reduce_hook(compressor: Compressor, module: FSDPModule, comm: GroupComm) -> Any:
    def hook(reduce_output: Tensor) -> None:
        # FSDP2 on the size-1 axis hands over this rank's whole unit gradient and divides by nothing.
        shapes, columns = _matrix_shapes(module, 1)
        if compressor.config.method in ("topk", "powersgd"):
            _check_layout(compressor, sum(columns), reduce_output.numel())
        reduce_output.copy_(compressor.reduce(reduce_output.float(), shapes, comm))

    return hook


def _check_layout(compressor: Compressor, expected: int, got: int) -> None:
    """The gradient buffer holds what the trainable parameters say, and the error-feedback residual fits it."""
    if expected != got:
        raise RuntimeError(
            f"Gradient compression ({compressor.config.method}) of unit {compressor.name}: FSDP2 reduces {got}"
            f" gradient elements where its trainable parameters hold {expected}: a trainable parameter got no"
            " gradient this step (not used in the forward). Freeze it (requires_grad=False) or use it every step."
        )
    residual = getattr(compressor, "residual", None)
    if residual is not None and residual.numel() != got:
        raise RuntimeError(
            f"Gradient compression ({compressor.config.method}) of unit {compressor.name}: its trainable parameters"
            " changed during training (frozen or unfrozen), so the error-feedback residual no longer fits them."
            " Freeze or unfreeze parameters before training starts, or train without lossy gradient compression."
        )
