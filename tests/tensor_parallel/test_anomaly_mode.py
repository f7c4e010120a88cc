"""Trainer(detect_anomaly=True) under tensor parallelism: anomaly mode checks every gradient for NaN with an
operator DTensor had no rule for (it failed at the first backward); with the rule, training is one process's and a
NaN on any rank's shard is seen by every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests.distributed import run_ranks
from tests.test_parity import _run, assert_parity, reference_for


def _nan_on_one_shard() -> list[bool]:
    from lightning_llmpar.tensor_parallel.apply_tp import _support_anomaly_checks

    dist.init_process_group("gloo")
    _support_anomaly_checks()
    mesh = init_device_mesh("cpu", (2,))
    found = []
    for nan_at in (None, 5):  # index 5 lies in rank 1's shard of 8 elements split in two
        full = torch.zeros(8)
        if nan_at is not None:
            full[nan_at] = float("nan")
        found.append(bool(torch.ops.aten._is_any_true(torch.isnan(distribute_tensor(full, mesh, [Shard(0)]))).item()))
    dist.destroy_process_group()
    return found


def test_a_nan_in_any_shard_is_seen_by_every_rank() -> None:
    assert run_ranks(_nan_on_one_shard, 2) == [[False, True], [False, True]]


def test_detect_anomaly_under_tensor_parallelism_trains_as_one_process() -> None:
    ref = reference_for("gpt", sgd=True, anomaly=True)
    outs, dp = _run("gpt", {"tensor_parallel": 2}, 2, sgd=True, anomaly=True)
    assert_parity(ref, outs, dp)
