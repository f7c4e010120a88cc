"""Pure data parallelism (ZeRO-0 and no other dimension) on DDP, as torchtitan runs one-dimensional data parallelism.

FSDP2 on a (dp, 1) mesh is what lets ZeRO-0 take tensor-parallel DTensors and pipeline stages, but with plain
replicated parameters it costs what DDP does not: it computes with a second, unsharded copy of every parameter
from forward to the end of backward, and on CPU (gloo) each unit's all-reduce blocks the backward thread. DDP's
reducer all-reduces 25 MiB buckets asynchronously as gradients appear, in place (``gradient_as_bucket_view``).

So where nothing needs FSDP2, the layout runs on torch's composable ``replicate`` (DDP without a wrapper, so
parameter names and checkpoints are unchanged). Everything else keeps FSDP2: another parallel dimension, ZeRO 1-3,
CPU offload, gradient compression (its hooks are FSDP2's), and precision plugins whose parameter casting or FP8
weights FSDP2 carries.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import DDP, replicate

from lightning_llmpar.layout import ParallelLayout

__all__ = ["DDP", "apply_replicate", "replicates"]

BUCKET_MB = 25  # DDP's default, as for the FSDP2 units at ZeRO 0-2 (data_parallel.fsdp.BUCKET_BYTES)


def replicates(layout: ParallelLayout, *, plain_precision: bool, compression: bool, cpu_offload: bool) -> bool:
    """Whether ``layout`` is pure data parallelism that DDP runs (see the module docstring)."""
    others = layout.tp * layout.cp * layout.pp * layout.ep
    return (layout.zero_stage == 0 and layout.dp > 1 and others == 1 and plain_precision and not compression
            and not cpu_offload)


def apply_replicate(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """DDP over ``group`` on ``model`` in place; the reducer is built at the first forward (after materialization)."""
    # find_unused_parameters: a step may leave parameters without a gradient (experts no token was routed to, a
    # head only validation uses), which FSDP2 takes in its stride and DDP would otherwise fail on one step later.
    # broadcast_buffers=False: buffers are built identically on every rank, as under FSDP2, which never syncs them.
    return replicate(model, process_group=group, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True,
                     broadcast_buffers=False, find_unused_parameters=True)
