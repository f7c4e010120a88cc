"""compile=True: every block compiled in place (torch.compile, inductor on CPU) trains exactly like one eager
process, under ZeRO-3, with activation checkpointing, and under pipeline parallelism."""

from __future__ import annotations

import shutil
from functools import cache
from typing import Any

import pytest

from lightning_llmpar import LLMParallelStrategy
from tests.distributed import run_ranks
from tests.zoo import assert_exact, fit_cases

pytest.importorskip("transformers")
# Inductor compiles C++ for CPU kernels.
pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="torch.compile on CPU needs a C++ compiler (g++)")

CASES = [
    ("llama", {"compile": True, "zero_stage": 3}, 4, {"tag": "zero3"}),
    ("llama", {"compile": True, "zero_stage": 2}, 4, {"tag": "zero2_checkpointing", "checkpointing": "full"}),
    ("llama", {"compile": True, "pipeline_parallel": 2}, 8, {"tag": "pp2"}),
]


@cache
def results() -> tuple[Any, list[Any]]:
    ref = run_ranks(fit_cases, 1, [("llama", None, 8, {"steps": 8, "tag": "ref"})])[0][("llama", "ref")]
    outs = run_ranks(fit_cases, 2, [(n, k, b, {**o, "steps": 8}) for n, k, b, o in CASES], timeout=900)
    return ref, outs


@pytest.mark.parametrize("tag", [c[3]["tag"] for c in CASES])
def test_compiled_blocks_train_like_one_eager_process(tag: str) -> None:
    ref, outs = results()
    runs = [o[("llama", tag)] for o in outs]
    assert_exact(ref, runs, sharded=False)
    assert all(r["compiled_frames"] > 0 for r in runs), "torch.compile compiled nothing"


def test_compile_with_dimensions_it_does_not_trace_is_refused() -> None:
    with pytest.raises(ValueError, match="compile=True does not combine with tensor_parallel"):
        LLMParallelStrategy(compile=True, tensor_parallel=2)
    with pytest.raises(ValueError, match="compile=True compiles the blocks inside the FSDP2 composition"):
        LLMParallelStrategy(compile=True, sharding_backend="deepspeed")
