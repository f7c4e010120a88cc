"""Running a LightningModule's step outside Lightning's own bookkeeping: metric updates (and logging) do nothing."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torchmetrics import Metric

__all__ = ["frozen_metrics", "quiet_step", "synced_only"]


@contextmanager
def frozen_metrics(module: nn.Module) -> Iterator[None]:
    """torchmetrics ``update`` calls inside ``module`` do nothing (steps that are not the real step)."""
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    saved = [m.__dict__.get("update") for m in metrics]
    for m in metrics:
        m.update = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m, update in zip(metrics, saved):
            if update is None:
                del m.update
            else:
                m.update = update  # type: ignore[method-assign]


@contextmanager
def quiet_step(module: nn.Module) -> Iterator[None]:
    """Frozen metrics, and ``log`` / ``log_dict`` do nothing."""
    module.log = module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        with frozen_metrics(module):
            yield
    finally:
        del module.log, module.log_dict  # the instance attributes shadowed the methods


def synced_only(metric: Metric) -> None:
    """``metric`` on a rank that never updates it but takes part in the sync that computes it (a pipeline stage
    before the last, whose states stay empty): its compute does not warn that update was never called."""
    if getattr(metric, "_synced_only", False):
        return
    compute = metric.compute

    @functools.wraps(compute)
    def quiet_compute(*args: object, **kwargs: object) -> object:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric .* before the ``update``")
            return compute(*args, **kwargs)

    metric.compute = quiet_compute  # type: ignore[method-assign]
    metric._synced_only = True
