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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_background_saves_on_a_gpu_hold_what_synchronous_saves_hold(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, background saves stage through pinned CPU memory while the next steps run on the device: the
    checkpoint of step 4 must hold step 4's weights and optimizer state, as a synchronous save does."""
    from lightning.pytorch import Trainer, seed_everything

    from lightning_llmpar import LLMParallelStrategy
    from lightning_llmpar.fault_tolerance.callbacks import FaultTolerantCheckpoint, checkpoint_problem
    from tests.checkpointing.test_async_checkpoint import _tensors
    from tests.distributed import free_port
    from tests.workloads import TokenData, make_gpt

    torch.backends.cuda.matmul.allow_tf32 = False
    # Lightning writes the rendezvous address into os.environ: set here, it is removed after the test.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name, background in (("sync", False), ("async", True)):
        seed_everything(0, verbose=False)
        trainer = Trainer(accelerator="cuda", devices=1, strategy=LLMParallelStrategy(async_checkpoint=background),
                          max_steps=6, logger=False, enable_progress_bar=False, limit_val_batches=0,
                          precision="32-true", callbacks=[FaultTolerantCheckpoint(str(tmp_path / name),
                                                                                  every_n_train_steps=2, keep_last=3)])
        try:
            trainer.fit(make_gpt(), datamodule=TokenData(8))
        finally:  # in this process: the next run (and test) starts without a process group
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    for step in (2, 4, 6):
        folder = f"step={step}.ckpt"
        assert checkpoint_problem(tmp_path / "async" / folder) is None
        expected, written = _tensors(tmp_path / "sync" / folder), _tensors(tmp_path / "async" / folder)
        assert written.keys() == expected.keys() and expected
        for key, value in expected.items():
            torch.testing.assert_close(written[key], value, atol=1e-6, rtol=0, msg=f"{folder}: {key}")
