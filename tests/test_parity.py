"""Every layout reproduces single-process training: loss over 10 steps, first-step gradients, final weights."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from tests.distributed import run_ranks
from tests.workloads import fit

GLOBAL_BATCH = 16
LOSS_TOL, GRAD_TOL, PARAM_TOL = 1e-5, 1e-5, 5e-4  # weights after 10 Adam steps amplify fp32 rounding


@cache
def reference_for(model: str, **kwargs: Any) -> dict[str, Any]:
    """Single-device Lightning run (no strategy of ours), computed once per test session and argument set."""
    return run_ranks(fit, 1, model, None, batch_size=GLOBAL_BATCH, **kwargs)[0]


def assert_parity(ref: dict[str, Any], outs: list[dict[str, Any]], dp: int) -> None:
    # Each dp rank logs the mean loss of its share of the batch; their mean is the global-batch loss.
    # Ranks of one tensor-parallel group hold identical losses, so averaging over all ranks is the same.
    steps = len(ref["losses"])
    assert steps >= 10 and all(len(o["losses"]) == steps for o in outs)
    for i in range(steps):
        loss = sum(o["losses"][i] for o in outs) / len(outs)
        assert abs(loss - ref["losses"][i]) < LOSS_TOL, f"step {i}: {loss} vs {ref['losses'][i]}"
    for out in outs:
        assert ref["grads"].keys() == out["grads"].keys()
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(out["grads"][name], grad, atol=GRAD_TOL, rtol=0, msg=f"grad {name}")
        for name, param in ref["params"].items():
            torch.testing.assert_close(out["params"][name], param, atol=PARAM_TOL, rtol=0, msg=f"param {name}")


LAYOUTS = [
    pytest.param({"tensor_parallel": 2}, 2, id="tp2"),
    pytest.param({"tensor_parallel": 2, "sequence_parallel": False}, 2, id="tp2-nosp"),
    pytest.param({"zero_stage": 0}, 2, id="dp2-zero0"),
    pytest.param({"zero_stage": 1}, 2, id="dp2-zero1"),
    pytest.param({"zero_stage": 2}, 2, id="dp2-zero2"),
    pytest.param({"zero_stage": 3}, 2, id="dp2-zero3"),
    pytest.param({"zero_stage": 3, "cpu_offload": True}, 2, id="dp2-zero3-offload"),
    pytest.param({"zero_stage": 3, "data_parallel_replicate": 2}, 4, id="hsdp-2x2"),
    pytest.param({"tensor_parallel": 2, "zero_stage": 3}, 4, id="tp2-dp2-zero3"),
    pytest.param({"tensor_parallel": 2, "zero_stage": 0}, 4, id="tp2-dp2-zero0"),
]


def _run(model: str, kwargs: dict[str, Any], world: int, **fit_kwargs: Any) -> tuple[list[dict[str, Any]], int]:
    dp = world // kwargs.get("tensor_parallel", 1)
    return run_ranks(fit, world, model, kwargs, batch_size=GLOBAL_BATCH // dp, **fit_kwargs), dp


def _assert_sharded(outs: list[dict[str, Any]], kwargs: dict[str, Any], world: int, name: str, full: tuple) -> None:
    # Guards against a layout silently running replicated: the weight each rank holds must be a shard.
    shards = kwargs.get("tensor_parallel", 1) * (world // kwargs.get("tensor_parallel", 1) if kwargs.get("zero_stage", 0) else 1)
    if kwargs.get("data_parallel_replicate"):
        shards //= kwargs["data_parallel_replicate"]
    local = outs[0]["local_shapes"][name]
    assert local[0] * shards == full[0], f"{name}: local {local}, full {full}, expected {shards} shards"


@pytest.mark.parametrize(("kwargs", "world"), LAYOUTS)
def test_gpt_layouts_match_single_process(kwargs: dict[str, Any], world: int) -> None:
    outs, dp = _run("gpt", kwargs, world)
    assert_parity(reference_for("gpt"), outs, dp)
    # The layouts step AdamW with torch's fused kernel (fused_optimizer=True), the reference with torch's loop;
    # a group that tensor parallelism alone leaves mixing plain tensors and DTensors runs it once per kind.
    kernels = set().union(*(o["kernels"] for o in outs))
    assert reference_for("gpt")["kernels"] == {"torch's choice"}
    # (With sequence parallelism the group of the norms mixes the two kinds.)
    split = kwargs.get("tensor_parallel", 1) > 1 and dp == 1 and kwargs.get("sequence_parallel", True)
    assert kernels == ({"fused", "fused per tensor kind"} if split else {"fused"}), kernels
    _assert_sharded(outs, kwargs, world, "model.layers.0.attn.q_proj.weight", (32, 32))


# The zoo runs transformers' Llama at tp2 and pp2, its tied sibling at ZeRO-3 and tp2 x pp2: here the layouts it does not.
LLAMA_LAYOUTS = [p for p in LAYOUTS if p.id in ("dp2-zero2", "hsdp-2x2")]


@pytest.mark.parametrize(("kwargs", "world"), LLAMA_LAYOUTS)
def test_transformers_llama_layouts_match_single_process(kwargs: dict[str, Any], world: int) -> None:
    pytest.importorskip("transformers")
    outs, dp = _run("llama", kwargs, world)
    assert_parity(reference_for("llama"), outs, dp)
    _assert_sharded(outs, kwargs, world, "model.model.layers.0.self_attn.q_proj.weight", (32, 32))


@pytest.mark.parametrize("kwargs", [pytest.param({"tensor_parallel": 2}, id="tp2"),
                                    pytest.param({"tensor_parallel": 2, "sequence_parallel": False}, id="tp2-nosp")])
def test_users_forward_hooks_see_the_output_the_model_goes_on_with(kwargs: dict[str, Any]) -> None:
    """A hook on the vocabulary-split embedding saw its partial sums (GELU crashed in backward, dropout at once);
    it now sees the whole output, with the global shape a size-scaled hook reads (not the sequence shard)."""
    pytest.importorskip("transformers")
    outs, dp = _run("llama_hooked", kwargs, 2, sgd=True)
    assert_parity(reference_for("llama_hooked", sgd=True), outs, dp)


@pytest.mark.parametrize(
    ("kwargs", "world"),
    [pytest.param({"tensor_parallel": 2, "zero_stage": 3}, 4, id="tp2-dp2-zero3"),
     pytest.param({"tensor_parallel": 2}, 2, id="tp2"),
     pytest.param({"zero_stage": 0}, 2, id="dp2-zero0")],
)
def test_accumulation_and_global_norm_clipping(kwargs: dict[str, Any], world: int) -> None:
    # SGD, because Adam would cancel a wrong clipping factor; clip at 0.1 so every step is clipped.
    ref = reference_for("gpt", accumulate=2, clip=0.1, sgd=True)
    outs, dp = _run("gpt", kwargs, world, accumulate=2, clip=0.1, sgd=True)
    assert_parity(ref, outs, dp)


def test_clipping_by_value_under_tensor_parallelism() -> None:
    # gradient_clip_algorithm="value" crashed at tp2: split weights' gradients are DTensors, the rest plain tensors,
    # and Lightning's one foreach clamp refused the mix. 0.002 clips a large share of every step's gradients.
    ref = reference_for("gpt", clip=0.002, clip_algorithm="value", sgd=True)
    outs, dp = _run("gpt", {"tensor_parallel": 2}, 2, clip=0.002, clip_algorithm="value", sgd=True)
    assert_parity(ref, outs, dp)
