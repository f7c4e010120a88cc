"""The ranks a logged value or a torchmetrics metric is reduced over: those that hold different data.

Lightning reduces ``self.log(..., sync_dist=True)`` over every process, and a torchmetrics ``Metric`` syncs its
states over every process unless given a ``process_group``. Tensor-parallel ranks run the same step on the same
batch, and under pipeline parallelism every stage logs the last stage's values again (``pipeline.logs``): a sum
over all processes counts each sample tp x pp times (a sample count logged with ``reduce_fx="sum"`` at tp2: 24
where one process logs 12; a ``SumMetric`` likewise). Means and maxima hid it.

- Logged values reduce over the data-parallel and context-parallel ranks ('dp_cp'), one copy of each batch.
- Metrics reduce over every rank but the tensor-parallel copies: under pipeline parallelism their states are
  updated on the last stage and zero on the others, so the stages' sum is the last stage's.
- Validation, test and predict steps run on whole sequences, so there context-parallel ranks are copies too: both
  reduce over the data-parallel ranks only (and the stages, for metrics); a validation sum at cp2 was twice one
  process's. The strategy switches the groups at each evaluation's start and end.
A group given explicitly (``sync_dist_group=``, a metric's ``process_group``) is left as it is.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchmetrics import Metric

from lightning_llmpar.layout import ParallelLayout

__all__ = ["apply_metric_groups", "log_group"]


_OURS = "_llmpar_sync_group"  # marks a metric whose process_group apply_metric_groups chose
_DATA = ("dp_replicate", "dp_shard", "cp")  # flattened as 'dp_cp' (and with 'pp' as 'pp_dp_cp') by the layout


def _flattened(mesh: DeviceMesh, axes: tuple[str, ...], name: str) -> Any:
    # The flattened mesh ParallelLayout.build_mesh made: flattening again under its name returns it.
    return mesh[axes]._flatten(name).get_group()


def log_group(layout: ParallelLayout, mesh: DeviceMesh, evaluating: bool = False) -> Any | None:
    """The group ``sync_dist`` reduces over (None: every process, where no rank holds a copy of another's data)."""
    if evaluating and layout.cp > 1:
        return _flattened(mesh, _DATA[:2], "dp")
    return _flattened(mesh, _DATA, "dp_cp") if layout.tp > 1 or layout.pp > 1 else None


def metric_group(layout: ParallelLayout, mesh: DeviceMesh, evaluating: bool = False) -> Any | None:
    """The group metrics sync over (None: every process, where no rank is a copy of another)."""
    if evaluating and layout.cp > 1:
        return _flattened(mesh, ("pp", *_DATA[:2]), "pp_dp") if layout.pp > 1 else _flattened(mesh, _DATA[:2], "dp")
    if layout.tp == 1:
        return None
    return _flattened(mesh, ("pp", *_DATA), "pp_dp_cp") if layout.pp > 1 else _flattened(mesh, _DATA, "dp_cp")


def apply_metric_groups(module: nn.Module, layout: ParallelLayout, mesh: DeviceMesh, evaluating: bool = False) -> None:
    """Give every torchmetrics ``Metric`` in ``module`` without a ``process_group`` of its own (or with one this
    function gave it) the metrics' group."""
    group = metric_group(layout, mesh, evaluating)
    for metric in module.modules():
        if isinstance(metric, Metric) and (metric.process_group is None or getattr(metric, _OURS, False)):
            metric.process_group = group
            setattr(metric, _OURS, True)
