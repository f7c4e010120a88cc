"""GPU checks (NCCL). CI has no GPU: these skip cleanly there; run them on a machine with GPUs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.test_parity import GLOBAL_BATCH, assert_parity, reference_for
from tests.workloads import fit

pytestmark = pytest.mark.gpu

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@needs_two_gpus
@pytest.mark.parametrize(
    "kwargs", [{"tensor_parallel": 2}, {"zero_stage": 3}, {"pipeline_parallel": 2}], ids=["tp2", "zero3", "pp2"]
)
def test_nccl_layouts_match_single_process(kwargs: dict[str, Any]) -> None:
    from tests.distributed import run_ranks

    dp = 2 // kwargs.get("tensor_parallel", 1) // kwargs.get("pipeline_parallel", 1)
    outs = run_ranks(fit, 2, "gpt", kwargs, batch_size=GLOBAL_BATCH // dp, accelerator="cuda")
    ref = reference_for("gpt")
    if "pipeline_parallel" in kwargs:
        from tests.pipeline.test_pipeline import assert_pipeline_parity

        assert_pipeline_parity(ref, outs)
    else:
        assert_parity(ref, outs, dp)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_strategy_runs_on_one_gpu() -> None:
    from lightning.pytorch import Trainer

    from lightning_llmpar import LLMParallelStrategy
    from tests.workloads import TokenData, make_gpt

    trainer = Trainer(accelerator="cuda", devices=1, strategy=LLMParallelStrategy(), max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0)
    trainer.fit(make_gpt(), datamodule=TokenData(8))
    assert trainer.global_step == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_precision_benchmark_runs_bf16_and_fp8(tmp_path: Any) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "precision.json"
    cmd = [sys.executable, "-m", "benchmarks.precision_gpu_bench", "--steps", "6", "--shapes", "tiny", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=1800)
    result = json.loads(out.read_text())
    runs = {r["precision"]: r for r in result["runs"]}
    assert runs["fp8"]["converted_fp8_linears"] > 0 and runs["bf16"]["converted_fp8_linears"] == 0
    assert result["summary"]["tiny"]["fp8_loss_rel_diff"] < 0.05
    if runs["bf16"]["peak_tflops"] is not None:  # a GPU in Lightning's peak table
        assert 0 < runs["bf16"]["mfu"] < 1
