"""The one place where techniques are composed, in the only order that works."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_llmpar.data_parallel import apply_data_parallel
from lightning_llmpar.layout import ParallelLayout
from lightning_llmpar.structure import find_block_stack
from lightning_llmpar.tensor_parallel import apply_tensor_parallel, infer_tp_plan

__all__ = ["ParallelConfig", "parallelize"]


@dataclass(frozen=True)
class ParallelConfig:
    """Per-technique options that are not degrees (those live in :class:`ParallelLayout`)."""

    sequence_parallel: bool = True
    tp_plan: Mapping[str, str] = field(default_factory=dict)
    cpu_offload: bool = False
    mp_policy: MixedPrecisionPolicy | None = None


def parallelize(model: nn.Module, layout: ParallelLayout, mesh: DeviceMesh, config: ParallelConfig) -> nn.Module:
    """Apply tensor parallelism, then data parallelism (ZeRO via FSDP2), to ``model`` in place.

    Order matters: tensor parallelism must come first because FSDP2 shards the DTensors TP produced
    along the data-parallel axis (giving dp x tp parameters); activation checkpointing will sit between
    the two so recomputation replays the sharded ops, and FSDP must wrap last so its hooks see the
    final modules.
    """
    if layout.tp > 1:
        plan = infer_tp_plan(model, layout.tp, sequence_parallel=config.sequence_parallel, user_plan=config.tp_plan)
        apply_tensor_parallel(model, mesh["tp"], plan)
    if layout.dp > 1 or config.cpu_offload:
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        apply_data_parallel(
            model,
            dp_mesh,
            zero_stage=layout.zero_stage,
            blocks=find_block_stack(model),
            cpu_offload=config.cpu_offload,
            mp_policy=config.mp_policy,
        )
    return model
