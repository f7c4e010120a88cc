"""Gradient compression: compressor math on known tensors, then real gloo runs through LLMParallelStrategy."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.data_parallel.compression.methods import (
    CompressionConfig,
    CompressionStats,
    LocalComm,
    dequantize_int8,
    make_compressor,
    quantize_int8,
)
from tests.distributed import run_ranks
from tests.pipeline.test_pipeline import assert_pipeline_parity
from tests.test_parity import GLOBAL_BATCH, assert_parity, reference_for
from tests.workloads import fit, full

ROOT = Path(__file__).resolve().parents[2]


def _compressor(value: str | dict[str, Any]) -> Any:
    return make_compressor(CompressionConfig.from_user(value), CompressionStats(), "unit")


# ----------------------------------------------------------------------------- one process, known tensors


def test_casts_are_exact_where_representable_and_bounded_elsewhere() -> None:
    exact = torch.arange(-64, 64, dtype=torch.float32) / 8  # representable in fp16 and bf16
    noisy = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    for method, eps in (("fp16", 2.0**-11), ("bf16", 2.0**-8)):
        comp = _compressor(method)
        assert torch.equal(comp.reduce(exact, [], LocalComm()), exact)
        out = comp.reduce(noisy, [], LocalComm())
        assert not torch.equal(out, noisy)
        assert ((out - noisy).abs() <= eps * noisy.abs() + 1e-7).all(), method
        assert comp.stats.raw_bytes == 2 * comp.stats.sent_bytes


def test_int8_error_is_at_most_half_a_step_per_chunk() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 10, 5000)
    codes, scales = quantize_int8(x, chunk_size=512)
    back = dequantize_int8(codes, scales, x.numel())
    step = scales.repeat_interleave(codes.shape[1])[: x.numel()]
    assert ((back - x).abs() <= step / 2 + 1e-6).all()
    assert codes.dtype == torch.int8 and scales.numel() == 10  # 5000 in 10 equal chunks of 500
    comp = _compressor({"method": "int8", "chunk_size": 512})
    torch.testing.assert_close(comp.reduce(x, [], LocalComm()), back, atol=0, rtol=0)
    assert comp.stats.raw_bytes / comp.stats.sent_bytes > 3.9


def test_topk_sends_the_largest_entries_and_keeps_the_rest() -> None:
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 1.0, -0.05])
    comp = _compressor({"method": "topk", "fraction": 0.25})
    out = comp.reduce(x, [], LocalComm())
    assert torch.equal(out, torch.tensor([0, -5.0, 0, 3.0, 0, 0, 0, 0]))
    assert torch.equal(comp.residual, x - out)
    assert comp.stats.sent_bytes == 2 * 8  # two (int32 index, fp32 value) pairs
    full = _compressor({"method": "topk", "fraction": 1.0})
    assert torch.equal(full.reduce(x, [], LocalComm()), x) and not full.residual.any()


def test_powersgd_recovers_low_rank_matrices_and_passes_vectors_exactly() -> None:
    g = torch.Generator().manual_seed(2)
    low = torch.randn(64, 2, generator=g) @ torch.randn(2, 48, generator=g)  # rank 2
    vec = torch.randn(48, generator=g)
    x = torch.cat([low.reshape(-1), vec])
    comp = _compressor({"method": "powersgd", "rank": 2, "start_step": 0})
    out = comp.reduce(x, [(64, 48), (48, 1)], LocalComm())
    torch.testing.assert_close(out, x, atol=1e-4, rtol=1e-4)
    assert comp.stats.raw_bytes / comp.stats.sent_bytes > 8
    before = _compressor({"method": "powersgd", "rank": 1, "start_step": 1})
    assert torch.equal(before.reduce(x, [(64, 48), (48, 1)], LocalComm()), x)  # step 1 <= start_step: exact
    assert before.residual is None


@pytest.mark.parametrize("value", [{"method": "topk", "fraction": 0.05},
                                   {"method": "topk", "fraction": 0.05, "start_step": 2},
                                   {"method": "powersgd", "rank": 1, "start_step": 0},
                                   {"method": "powersgd", "rank": 2, "start_step": 0, "warm_start": False}])
def test_error_feedback_conserves_the_gradient(value: dict[str, Any]) -> None:
    # applied_t + residual_t = g_t + residual_{t-1}: summed over steps nothing is lost, only delayed.
    comp = _compressor(value)
    g = torch.Generator().manual_seed(3)
    shapes = [(32, 24), (24, 1)]
    grads = [torch.randn(32 * 24 + 24, generator=g) for _ in range(6)]
    applied = sum(comp.reduce(x, shapes, LocalComm()) for x in grads)
    assert comp.residual.norm() > 0.1  # it is lossy, so the identity below has something to prove
    torch.testing.assert_close(applied + comp.residual, sum(grads), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- configuration errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gradient_compression": "zip"}, r"gradient_compression='zip' is not a known method: use one of \('fp16'"),
        ({"gradient_compression": {"fraction": 0.1}}, r"gradient_compression=\{'fraction': 0.1\} names no method: add 'method'"),
        ({"gradient_compression": {"method": "topk", "rank": 4}},
         r"\['rank'\] are not options of method='topk'; it takes \['fraction', 'start_step'\]"),
        ({"gradient_compression": {"method": "topk", "fraction": 0}}, r"fraction=0 must be in \(0, 1\]"),
        ({"gradient_compression": {"method": "powersgd", "rank": 0}}, r"rank=0 must be a positive integer"),
        ({"gradient_compression": {"method": "powersgd", "start_step": -1}},
         r"start_step=-1 must be an integer >= 0"),
        ({"gradient_compression": "topk", "zero_stage": 2},
         (r"'topk' cannot run with zero_stage=2.*zero_stage=0: fp16, bf16, int8, topk, powersgd"
          r".*zero_stage=2: fp16, bf16, int8")),
        ({"gradient_compression": "powersgd", "zero_stage": 3},
         r"'powersgd' cannot run with zero_stage=3.*Use zero_stage 0 or 1"),
        ({"gradient_compression": "int8", "zero_stage": 3, "data_parallel_replicate": 2},
         r"does not support hybrid sharding"),
        ({"gradient_compression": {"method": "topk"}, "sharding_backend": "deepspeed", "zero_stage": 2},
         r"configures the 'fsdp2' backend's compressors; with sharding_backend='deepspeed' use 'onebit_adam'"),
    ],
)
def test_refused_settings_name_the_value_and_the_fix(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLMParallelStrategy(**kwargs)


def test_yaml_config_builds_a_compressing_strategy() -> None:
    from lightning_llmpar.cli import main

    cli = main(["--config", str(ROOT / "examples/configs/dp2_powersgd.yaml")], run=False)
    config = cli.trainer.strategy.options.compression
    assert (config.method, config.rank, config.start_step) == ("powersgd", 4, 20)


# ----------------------------------------------------------------------------- real gloo runs


TOPK_ALL = {"method": "topk", "fraction": 1.0}  # every entry sent: lossless


def _run(kwargs: dict[str, Any], world: int, **fit_kwargs: Any) -> list[dict[str, Any]]:
    dp = world // kwargs.get("tensor_parallel", 1) // kwargs.get("pipeline_parallel", 1)
    return run_ranks(fit, world, "gpt", kwargs, batch_size=GLOBAL_BATCH // dp, **fit_kwargs)


@pytest.mark.parametrize(
    ("kwargs", "world"),
    [
        pytest.param({"zero_stage": 0, "gradient_compression": TOPK_ALL}, 2, id="dp2-zero0-topk1"),
        pytest.param({"zero_stage": 1, "gradient_compression": {"method": "powersgd", "start_step": 100}}, 2,
                     id="dp2-zero1-powersgd-before-start"),
        pytest.param({"tensor_parallel": 2, "gradient_compression": TOPK_ALL}, 4, id="tp2-dp2-zero0-topk1"),
        pytest.param({"pipeline_parallel": 2, "zero_stage": 1, "gradient_compression": TOPK_ALL}, 4,
                     id="pp2-dp2-zero1-topk1"),
    ],
)
def test_lossless_settings_reproduce_single_process(kwargs: dict[str, Any], world: int) -> None:
    outs = _run(kwargs, world)
    if "pipeline_parallel" in kwargs:
        assert_pipeline_parity(reference_for("gpt"), outs)
    else:
        assert_parity(reference_for("gpt"), outs, dp=2)
    # The compressor really carried the gradients: its byte counts were logged.
    logged = outs[0]["logged"]
    expected = 0.5 if kwargs["gradient_compression"]["method"] == "topk" else 1.0  # index + value per entry
    assert logged["compression/ratio"] == pytest.approx(expected)
    assert logged["compression/residual_norm"] == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [pytest.param({"zero_stage": 1, "gradient_compression": TOPK_ALL}, id="zero1-topk1"),
     pytest.param({"zero_stage": 0, "gradient_compression": TOPK_ALL}, id="zero0-topk1")],
)
def test_frozen_parameters_beside_trainable_ones_compress_exactly(kwargs: dict[str, Any]) -> None:
    # FSDP2 reduces only the parameters with a gradient: the compressor laid its matrices out over every
    # parameter of the unit and crashed (top-k and PowerSGD at ZeRO-1, PowerSGD at ZeRO-0).
    outs = run_ranks(fit, 2, "gpt_partly_frozen", kwargs, batch_size=GLOBAL_BATCH // 2)
    assert_parity(reference_for("gpt_partly_frozen"), outs, dp=2)


def test_powersgd_trains_beside_frozen_parameters_and_leaves_them_unchanged() -> None:
    kwargs = {"zero_stage": 0, "gradient_compression": {"method": "powersgd", "rank": 2, "start_step": 4}}
    outs = run_ranks(fit, 2, "gpt_partly_frozen", kwargs, batch_size=GLOBAL_BATCH // 2, **CONVERGE)
    ref = reference_for("gpt_partly_frozen", **CONVERGE)
    first, last = (sum(o["losses"][i] for o in outs) / 2 for i in (0, -1))
    assert first - last > 0.5 * (ref["losses"][0] - ref["losses"][-1]), (first, last, ref["losses"])
    for name in ("model.layers.0.attn.q_proj.weight", "model.layers.1.mlp_norm.weight"):
        assert torch.equal(outs[0]["params"][name], ref["params"][name]), name  # the initial weights


def test_lossless_compressed_run_equals_uncompressed_run() -> None:
    plain = _run({"zero_stage": 0}, 2)
    packed = _run({"zero_stage": 0, "gradient_compression": {"method": "topk", "fraction": 1.0}}, 2)
    assert packed[0]["logged"]["compression/ratio"] == 0.5 and "compression/ratio" not in plain[0]["logged"]
    for a, b in zip(plain, packed):
        assert a["losses"] == pytest.approx(b["losses"], abs=1e-6, rel=0)
        for name, grad in a["grads"].items():
            torch.testing.assert_close(b["grads"][name], grad, atol=1e-7, rtol=0)


def test_compression_without_data_parallelism_is_refused() -> None:
    # tp2 with no data-parallel axis: the compressor would have nothing to act on (tensor-parallel traffic is
    # never compressed), so the option would be silently ignored. Refused when the Trainer is built.
    with pytest.raises(ValueError, match=r"gradient_compression='int8' compresses the data-parallel gradient sync, but this layout has one data-parallel rank"):
        Trainer(accelerator="cpu", devices=2, strategy=LLMParallelStrategy(tensor_parallel=2, gradient_compression="int8"))


# Lossy settings on a tiny model that can memorise its 32 samples in 24 steps: the loss must fall at least
# half as far as the uncompressed run's does (a compressor that broke the sync would not learn at all, and
# 24 steps is too short for error feedback to catch up fully), and the bytes must shrink as promised.
LOSSY = [
    pytest.param({"zero_stage": 0, "gradient_compression": "fp16"}, 2, 1.99, id="dp2-zero0-fp16"),
    pytest.param({"zero_stage": 2, "gradient_compression": "bf16"}, 2, 1.99, id="dp2-zero2-bf16"),
    pytest.param({"zero_stage": 3, "gradient_compression": "int8"}, 2, 3.5, id="dp2-zero3-int8"),
    pytest.param({"zero_stage": 1, "gradient_compression": {"method": "topk", "fraction": 0.1}}, 2, 4.9,
                 id="dp2-zero1-topk"),
    pytest.param({"zero_stage": 0, "gradient_compression": {"method": "powersgd", "rank": 2, "start_step": 4}}, 2, 3.0,
                 id="dp2-zero0-powersgd"),
]
CONVERGE = {"steps": 24, "samples": 32}


@pytest.mark.parametrize(("kwargs", "world", "min_ratio"), LOSSY)
def test_lossy_compressors_train_like_uncompressed(kwargs: dict[str, Any], world: int, min_ratio: float) -> None:
    ref = reference_for("gpt", **CONVERGE)
    outs = _run(kwargs, world, **CONVERGE)
    losses = [sum(o["losses"][i] for o in outs) / len(outs) for i in range(CONVERGE["steps"])]
    drop, ref_drop = losses[0] - losses[-1], ref["losses"][0] - ref["losses"][-1]
    assert ref_drop > 1.0 and drop > 0.5 * ref_drop, (losses, ref["losses"])
    assert losses != pytest.approx(ref["losses"], abs=1e-6), "a lossy compressor must change the trajectory"
    logged = outs[0]["logged"]
    assert logged["compression/ratio"] >= min_ratio
    assert logged["compression/raw_bytes"] > logged["compression/sent_bytes"] > 0
    error_feedback = kwargs["gradient_compression"] if isinstance(kwargs["gradient_compression"], dict) else {}
    assert (logged["compression/residual_norm"] > 0) == (error_feedback.get("method") in ("topk", "powersgd"))


class _GradsAt(Callback):
    """Writes this rank's full gradients of optimizer step ``step`` (after the data-parallel sync) to a file."""

    def __init__(self, step: int, folder: str) -> None:
        self.step, self.folder = step, folder

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == self.step:
            grads = {n: full(p.grad).cpu() for n, p in pl_module.named_parameters() if p.grad is not None}
            torch.save(grads, Path(self.folder) / f"grads{trainer.global_rank}.pt")


@pytest.mark.parametrize(
    "compression",
    [pytest.param({"method": "powersgd", "rank": 2, "start_step": 2}, id="powersgd"),
     pytest.param({"method": "topk", "fraction": 0.05}, id="topk")],
)
def test_resume_restores_compressor_state(tmp_path: Path, compression: dict[str, Any]) -> None:
    # The synced gradients of the first step after a resume depend on the weights, the batch and the
    # compressor state (residuals, PowerSGD's Q): they must equal the uninterrupted run's at that step.
    kwargs = {"zero_stage": 1 if compression["method"] == "topk" else 0, "gradient_compression": compression}
    run = {"samples": 80, "batch_size": 8}  # 5 steps per epoch: the checkpoint falls on an epoch boundary
    run_ranks(fit, 2, "gpt", kwargs, steps=6, callbacks_extra=[_GradsAt(5, str(tmp_path))], **run)
    whole = [torch.load(tmp_path / f"grads{r}.pt") for r in range(2)]
    path = tmp_path / "epoch0.ckpt"
    run_ranks(fit, 2, "gpt", kwargs, steps=-1, epochs=1, save_to=str(path), **run)
    assert sorted(p.name for p in path.glob("compression_rank*.pt")) == ["compression_rank0.pt", "compression_rank1.pt"]
    resumed = run_ranks(fit, 2, "gpt", kwargs, steps=6, ckpt_path=str(path), **run)
    for rank, out in enumerate(resumed):
        assert out["grads"].keys() == whole[rank].keys()
        for name, grad in whole[rank].items():
            torch.testing.assert_close(out["grads"][name], grad, atol=1e-6, rtol=0, msg=name)
    # Without the saved state the same resume syncs different gradients: the state is what made it exact.
    for p in path.glob("compression_rank*.pt"):
        p.unlink()
    # Its manifest would refuse the folder as incomplete: without it, it loads as one written before manifests.
    (path / "llmpar-manifest.json").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reset = run_ranks(fit, 2, "gpt", kwargs, steps=6, ckpt_path=str(path), **run)
    assert any((reset[0]["grads"][n] - g).abs().max() > 1e-4 for n, g in whole[0].items())
