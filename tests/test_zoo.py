"""Third-party architectures, tied and untied, under TP, PP, ZeRO-3 and a 4-rank combination: exact vs one process.

All cases of one world size run inside one launch of the ranks; each model's one-process reference runs once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import run_ranks
from tests.zoo import fit_cases

pytest.importorskip("transformers")

MODELS = [
    "llama", "llama_tied", "qwen2", "qwen2_tied", "qwen3", "mistral", "gemma2", "phi3", "phi3_gqa", "gpt2",
    "gpt2_untied", "gpt_neox", "opt", "mixtral", "olmo2", "starcoder2", "falcon", "bloom", "granite", "qwen3_moe",
]
GLOBAL_BATCH = 8
TWO_RANKS = {
    "tp2": {"tensor_parallel": 2},
    "pp2": {"pipeline_parallel": 2},
    "dp2-zero3": {"zero_stage": 3},
}
FOUR_RANKS = {"tp2-pp2": {"tensor_parallel": 2, "pipeline_parallel": 2}}
LOSS_TOL, GRAD_TOL = 1e-5, 1e-5


def _batch(kwargs: dict[str, Any], world: int) -> int:
    return GLOBAL_BATCH * kwargs.get("tensor_parallel", 1) * kwargs.get("pipeline_parallel", 1) // world


def _launch(layouts: dict[str, dict[str, Any]], world: int) -> dict[tuple[str, str], list[dict[str, Any]]]:
    cases = [(m, kw, _batch(kw, world)) for kw in layouts.values() for m in MODELS]
    outs = run_ranks(fit_cases, world, cases, timeout=1500)
    return {(m, lid): [o[(m, repr(kw))] for o in outs] for lid, kw in layouts.items() for m in MODELS}


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    outs = run_ranks(fit_cases, 1, [(m, None, GLOBAL_BATCH) for m in MODELS], timeout=900)[0]
    return {m: outs[(m, "None")] for m in MODELS}


@pytest.fixture(scope="module")
def two_rank_runs() -> dict[tuple[str, str], list[dict[str, Any]]]:
    return _launch(TWO_RANKS, 2)


@pytest.fixture(scope="module")
def four_rank_runs() -> dict[tuple[str, str], list[dict[str, Any]]]:
    return _launch(FOUR_RANKS, 4)


def assert_exact(ref: dict[str, Any], outs: list[dict[str, Any]]) -> None:
    assert "error" not in ref, ref.get("error")
    for out in outs:
        assert "error" not in out, out["error"]
    steps = len(ref["losses"])
    assert steps >= 6 and all(len(o["losses"]) == steps for o in outs)
    for i in range(steps):
        loss = sum(o["losses"][i] for o in outs) / len(outs)
        assert abs(loss - ref["losses"][i]) < LOSS_TOL, f"step {i}: {loss} vs {ref['losses'][i]}"
    grads: dict[str, torch.Tensor] = {}
    for out in outs:
        grads.update(out["grads"])
    assert sorted(grads) == sorted(ref["grads"]), "every parameter gets its gradient on some rank"
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(grads[name], grad, atol=GRAD_TOL, rtol=1e-4, msg=f"grad {name}")
    # No layout may run silently replicated: each rank holds a fraction of the parameters.
    assert all(o["held"] < 0.8 for o in outs), [o["held"] for o in outs]


@pytest.mark.parametrize("layout", list(TWO_RANKS))
@pytest.mark.parametrize("model", MODELS)
def test_two_ranks_match_one_process(model: str, layout: str, references: dict, two_rank_runs: dict) -> None:
    assert_exact(references[model], two_rank_runs[(model, layout)])


@pytest.mark.parametrize("layout", list(FOUR_RANKS))
@pytest.mark.parametrize("model", MODELS)
def test_four_ranks_match_one_process(model: str, layout: str, references: dict, four_rank_runs: dict) -> None:
    assert_exact(references[model], four_rank_runs[(model, layout)])


SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def test_tied_weights_stay_tied_under_every_schedule_and_zero(references: dict) -> None:
    # Stage copies of a tied embedding/head: on two ranks (interleaved) or on one rank (V-shaped schedules),
    # alone and with the stages sharded by ZeRO.
    two = [("llama_tied", {"pipeline_parallel": 2, "pipeline_schedule": s}, GLOBAL_BATCH) for s in SCHEDULES]
    four = [("llama_tied", {"pipeline_parallel": 2, "zero_stage": 3}, GLOBAL_BATCH // 2),
            ("llama_tied", {"pipeline_parallel": 2, "zero_stage": 2, "pipeline_schedule": "ZBVZeroBubble"}, GLOBAL_BATCH // 2)]
    for cases, world in ((two, 2), (four, 4)):
        outs = run_ranks(fit_cases, world, cases, timeout=900)
        for name, kwargs, _ in cases:
            assert_exact(references[name], [o[(name, repr(kwargs))] for o in outs])
