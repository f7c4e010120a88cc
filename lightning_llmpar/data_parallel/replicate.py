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

import inspect
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from torch import Tensor, nn
from torch.distributed._composable.replicate import DDP, replicate
from torch.nn.parallel import DistributedDataParallel

from lightning_llmpar.layout import ParallelLayout

__all__ = ["DDP", "ManualBackwardRedirection", "apply_replicate", "prepare_manual_backward", "replicates"]

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
    return replicate(model, process_group=group, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True,
                     find_unused_parameters=True, **_NO_BUFFER_SYNC)


# Buffers are built identically on every rank, as under FSDP2, which never syncs them: no sync before each forward.
# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers and warns on the old name.
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                   if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                   else {"broadcast_buffers": False})


def _reducer_owner(module: nn.Module | None) -> DistributedDataParallel | None:
    """The DistributedDataParallel behind ``replicate`` (it exists from the first forward on)."""
    return getattr(replicate.state(module), "_ddp", None) if isinstance(module, DDP) else None


# Manual optimization runs backward inside the training step, so inside DDP's forward, before DDP would prepare its
# reducer for it (after the forward). As Lightning's DDPStrategy does: the reducer is prepared before that backward
# from its loss, and DDP's own preparation after the forward is skipped.


def prepare_manual_backward(module: nn.Module | None, loss: Tensor) -> None:
    ddp = _reducer_owner(module)
    if ddp is not None:
        prepare_for_backward(ddp, loss)


class ManualBackwardRedirection(_ForwardRedirection):
    """Lightning's redirection of step methods through the root's forward, plus the skip above."""

    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: pl.LightningModule) -> None:
        ddp = _reducer_owner(wrapper_module)
        if ddp is not None and not original_module.automatic_optimization:
            ddp.require_backward_grad_sync = False  # set again by the next forward's pre-hook

    def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: Any) -> None:
        return None
