"""Activation checkpointing changes memory, never results: every mode reproduces training without it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_llmpar.activation_checkpoint import (
    ActivationCheckpointing,
    CheckpointPlan,
    apply_activation_checkpointing,
    saved_activation_bytes,
)
from lightning_llmpar.models.gpt import GPT, GPTConfig
from tests.distributed import run_ranks
from tests.test_parity import GLOBAL_BATCH, assert_parity, reference_for
from tests.test_pipeline import assert_pipeline_parity

MODES = [
    {"mode": "full"},
    {"mode": "every_k", "every": 2},
    {"mode": "selective", "save": "attention"},
    {"mode": "selective", "save": "attention_and_matmuls"},
]


def _grads_and_saved(plan: CheckpointPlan) -> tuple[torch.Tensor, int, int]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, block_size=64))
    wrapped = apply_activation_checkpointing(list(model.layers), plan)
    x = torch.randint(0, 256, (2, 64))
    saved = saved_activation_bytes(lambda: model(x).sum())
    F.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), wrapped, saved


@pytest.mark.parametrize("kwargs", MODES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_gradients_identical_to_no_checkpointing(kwargs: dict[str, Any]) -> None:
    reference, _, kept_without = _grads_and_saved(CheckpointPlan("none"))
    grads, wrapped, kept = _grads_and_saved(CheckpointPlan(**kwargs))
    assert wrapped == (2 if kwargs["mode"] == "every_k" else 4)
    torch.testing.assert_close(grads, reference, atol=0, rtol=0)
    # Outside the checkpointed blocks autograd keeps much less (block inputs instead of every activation).
    assert kept < kept_without


@pytest.mark.parametrize(
    ("kwargs", "world", "checkpointing"),
    [
        pytest.param({"tensor_parallel": 2, "zero_stage": 3}, 4, {"mode": "selective"}, id="tp2-dp2-zero3-selective"),
        pytest.param({"zero_stage": 3}, 2, {"mode": "full"}, id="dp2-zero3-full"),
    ],
)
def test_checkpointing_under_parallel_layouts(kwargs: dict[str, Any], world: int, checkpointing: dict[str, Any]) -> None:
    from tests.workloads import fit

    dp = world // kwargs.get("tensor_parallel", 1)
    outs = run_ranks(fit, world, "gpt", kwargs, batch_size=GLOBAL_BATCH // dp, checkpointing=checkpointing)
    assert all(o["checkpointing_applied"] for o in outs)
    assert_parity(reference_for("gpt"), outs, dp)


def test_checkpointing_under_pipeline() -> None:
    from tests.workloads import fit

    outs = run_ranks(fit, 2, "gpt", {"pipeline_parallel": 2}, batch_size=GLOBAL_BATCH, checkpointing={"mode": "every_k"})
    assert all(o["checkpointing_applied"] for o in outs)
    assert_pipeline_parity(reference_for("gpt"), outs)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=r"mode='some' is not one of"):
        ActivationCheckpointing(mode="some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"every=0 must be at least 1"):
        ActivationCheckpointing(mode="every_k", every=0)
