"""Precision plugins under parallel layouts: close to fp32 training, overflow decisions shared by all ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_llmpar.precision.fp8 import fp8_candidates
from lightning_llmpar.precision.plugins import BF16Precision, FP8Precision, FP16Precision
from tests.distributed import run_ranks
from tests.test_parity import GLOBAL_BATCH, reference_for
from tests.workloads import InjectInf, StepRecorder, fit, fit_error, make_gpt

FP8_CPU = {"base": "32-true"}  # bf16 matmuls are ~50x slower than fp32 on this kind of CPU

CASES = [
    # (plugin, kwargs, strategy kwargs, world, loss tolerance vs fp32)
    pytest.param("BF16Precision", {}, {"zero_stage": 3}, 2, 5e-3, id="bf16-mixed-dp2-zero3"),
    # 'true' computes the loss itself in bf16 (spacing 0.03 near 4.3): the tolerance is its rounding.
    pytest.param("BF16Precision", {"mode": "true"}, {"tensor_parallel": 2}, 2, 6e-2, id="bf16-true-tp2"),
    pytest.param("BF16Precision", {}, {"pipeline_parallel": 2, "tensor_parallel": 2}, 4, 5e-3, id="bf16-mixed-pp2-tp2"),
    pytest.param("FP16Precision", {}, {"tensor_parallel": 2, "zero_stage": 3}, 4, 2e-3, id="fp16-tp2-dp2-zero3"),
    pytest.param("FP16Precision", {}, {"pipeline_parallel": 2}, 2, 2e-3, id="fp16-pp2"),
    pytest.param("FP8Precision", FP8_CPU, {"tensor_parallel": 2, "zero_stage": 3}, 4, 1e-2, id="fp8-tensorwise-tp2-dp2-zero3"),
    pytest.param("FP8Precision", {**FP8_CPU, "recipe": "rowwise"}, {"zero_stage": 3}, 2, 1e-2, id="fp8-rowwise-dp2-zero3"),
    pytest.param("FP8Precision", {**FP8_CPU, "float8_all_gather": False}, {"pipeline_parallel": 2}, 2, 1e-2, id="fp8-pp2"),
]


def _dp(kwargs: dict[str, Any], world: int) -> int:
    return world // kwargs.get("tensor_parallel", 1) // kwargs.get("pipeline_parallel", 1)


@pytest.mark.parametrize(("plugin", "plugin_kwargs", "kwargs", "world", "tol"), CASES)
def test_precision_tracks_fp32_under_layouts(
    plugin: str, plugin_kwargs: dict[str, Any], kwargs: dict[str, Any], world: int, tol: float
) -> None:
    # SGD: a gradient-scale error (a loss scale left in, a missing reduction) shows in the gradients and losses.
    ref = reference_for("gpt", sgd=True)
    outs = run_ranks(fit, world, "gpt", kwargs, batch_size=GLOBAL_BATCH // _dp(kwargs, world),
                     precision=(plugin, plugin_kwargs), sgd=True)
    steps = len(ref["losses"])
    losses = [sum(o["losses"][i] for o in outs) / len(outs) for i in range(steps)]
    diffs = [abs(a - b) for a, b in zip(losses, ref["losses"])]
    assert max(diffs) < tol, f"loss vs fp32: {losses} vs {ref['losses']}"
    # ...and not fp32 in disguise: lower precision must leave a trace in the losses.
    assert max(diffs) > 1e-6, "losses identical to fp32: the plugin did not change the compute dtype"
    grads: dict[str, torch.Tensor] = {}
    for out in outs:
        grads.update(out["grads"])
    # Rounding leaves a few percent over all gradients (more on small ones); a scale error is a factor of 2 or more.
    diff = torch.cat([(grads[n] - g).flatten() for n, g in ref["grads"].items()])
    total = torch.cat([g.flatten() for g in ref["grads"].values()])
    assert float(diff.norm() / total.norm()) < 0.05, float(diff.norm() / total.norm())
    for name, g in ref["grads"].items():
        rel = float((grads[name] - g).norm() / g.norm().clamp_min(1e-12))
        assert rel < 0.5, f"first-step gradient of {name} is {rel:.3g} off fp32 (relative)"
    report = outs[0]["plugin"]
    assert report["type"] == plugin
    if plugin == "FP8Precision":
        # Default keep_first_last: blocks 1 and 2 of 4 convert, block 0, block 3 and the LM head do not.
        assert report["converted"] and all(".layers.1." in n or ".layers.2." in n for n in report["converted"])
        expected = "WeightWithDynamicFloat8CastTensor" if plugin_kwargs.get("float8_all_gather", plugin_kwargs.get("recipe") != "rowwise") else "Tensor"
        if kwargs.get("pipeline_parallel", 1) == 1:
            assert report["fp8_weight_types"] == [expected]


def test_plugins_under_lightnings_own_strategy() -> None:
    # A one-process reference with the plugin and strategy="auto": FP8 and bf16 'true' trained in fp32, silently.
    fp8 = ("FP8Precision", {**FP8_CPU, "float8_all_gather": False})
    plain, ours = run_ranks(fit, 1, "gpt", None, precision=fp8, sgd=True), run_ranks(fit, 1, "gpt", {}, precision=fp8, sgd=True)
    assert plain[0]["losses"] == pytest.approx(ours[0]["losses"], abs=1e-6, rel=0)
    assert max(abs(a - b) for a, b in zip(plain[0]["losses"], reference_for("gpt", sgd=True)["losses"])) > 1e-6
    error = run_ranks(fit_error, 1, "gpt", None, precision=("BF16Precision", {"mode": "true"}))[0]
    assert error and error.startswith("ValueError") and "LLMParallelStrategy()" in error, error


@pytest.mark.parametrize(
    ("kwargs", "world", "rank"),
    [
        pytest.param({"tensor_parallel": 2, "zero_stage": 2}, 4, 3, id="tp2-dp2-zero2-rank3"),
        pytest.param({"pipeline_parallel": 2}, 2, 0, id="pp2-first-stage"),
    ],
)
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(kwargs: dict[str, Any], world: int, rank: int) -> None:
    bad_step = 3
    outs = run_ranks(
        fit, world, "gpt", kwargs, steps=6, batch_size=GLOBAL_BATCH // _dp(kwargs, world),
        precision=("FP16Precision", {"init_scale": 1024.0}),
        callbacks_extra=[InjectInf(rank, bad_step), StepRecorder()],
    )
    records = [o["extra"][1] for o in outs]
    for record in records:
        assert record["updated"] == [i != bad_step for i in range(6)], record["updated"]
        assert record["scales"] == [1024.0] * bad_step + [512.0] * (6 - bad_step)
    # Replicas stay identical: every rank ends with the same full weights.
    for out in outs[1:]:
        if kwargs.get("pipeline_parallel", 1) == 1:
            for name, param in outs[0]["params"].items():
                torch.testing.assert_close(out["params"][name], param, atol=0, rtol=0)


def test_lightning_reads_the_precision_the_run_trains_in() -> None:
    # trainer.precision read "bf16-mixed" for a bf16-true run (and so did loggers' hyperparameters).
    from lightning.pytorch import Trainer

    from lightning_llmpar import LLMParallelStrategy

    for flag in ("bf16-true", "bf16-mixed", "32-true"):
        trainer = Trainer(strategy=LLMParallelStrategy(), precision=flag, devices=1, accelerator="cpu", logger=False,
                          enable_checkpointing=False)
        assert trainer.precision == flag
    assert BF16Precision(mode="true").precision == "bf16-true"
    with BF16Precision(mode="true", device="cpu").autocast_context_manager():  # still bf16 if asked for
        assert torch.ones(2, 2).mm(torch.ones(2, 2)).dtype == torch.bfloat16


def test_fp8_candidates_respect_shape_and_first_last() -> None:
    model = make_gpt()  # 4 blocks, width 32, vocab 64
    names = fp8_candidates(model)
    assert names and all(".layers.1." in n or ".layers.2." in n for n in names)
    everything = fp8_candidates(model, keep_first_last=False)
    assert "model.lm_head" in everything and any(".layers.0." in n for n in everything)
    assert not any("q_proj" in n for n in fp8_candidates(model, keep_first_last=False, skip=["q_proj"]))
    # One string is one pattern: its letters were taken as patterns, keeping nearly every linear out of FP8.
    assert fp8_candidates(model, keep_first_last=False, skip="q_proj") == fp8_candidates(
        model, keep_first_last=False, skip=["q_proj"])
    assert FP8Precision(skip="lm_head").skip == ["lm_head"]
    odd = nn.Sequential(nn.Linear(24, 20))
    assert fp8_candidates(odd, keep_first_last=False) == []  # 20 is not a multiple of 16
    # The advice names the reason (it advised more blocks or keep_first_last=False for a width FP8 cannot take).
    with pytest.raises(ValueError, match=r"no linear layer to convert in Sequential: of its linears, 1 with a dimension"
                                         r" not divisible by 16"):
        FP8Precision(**FP8_CPU).convert_before_parallelism(odd)


def test_fp8_keeps_a_tied_head_in_higher_precision_and_tied() -> None:
    # torchao gives a converted layer a weight of its own: the head and the embedding trained as two copies of one
    # storage (the optimizer stepped it twice; 0.07 apart from one process after four steps at ZeRO-3).
    model = make_gpt()
    model.model.lm_head.weight = model.model.tok_emb.weight
    assert "model.lm_head" not in fp8_candidates(model, keep_first_last=False)
    FP8Precision(**FP8_CPU, keep_first_last=False).convert_before_parallelism(model)
    assert model.model.lm_head.weight is model.model.tok_emb.weight
    assert len(list(model.parameters())) == len(list(make_gpt().parameters())) - 1


def test_bad_precision_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="mode must be 'mixed' or 'true'"):
        BF16Precision(mode="half")
    with pytest.raises(ValueError, match="use 'float32', 'bfloat16' or 'float16'"):
        BF16Precision(reduce_dtype="int8")
    with pytest.raises(ValueError, match="growth_factor > 1"):
        FP16Precision(growth_factor=0.5)
    with pytest.raises(ValueError, match="needs recipe='tensorwise'"):
        FP8Precision(recipe="rowwise", float8_all_gather=True)
    assert FP8Precision(recipe="rowwise").float8_all_gather is False  # the default follows the recipe
    assert FP8Precision().float8_all_gather is True
    with pytest.raises(ValueError, match="recipe must be one of"):
        FP8Precision(recipe="mxfp8")


@pytest.mark.parametrize(("name", "kwargs", "world"), [
    pytest.param("gpt", {"tensor_parallel": 2, "pipeline_parallel": 2}, 4, id="tp2-pp2"),
    # A head tied to the embedding is a matmul all the same: it was left out (MFU 28% low), and under pipeline
    # parallelism its copy on the last stage is the one the counts skip.
    pytest.param("llama_tied", {"pipeline_parallel": 2, "pipeline_schedule": "1F1B"}, 2, id="tied-pp2"),
])
def test_flops_per_device_count_the_whole_model_once(name: str, kwargs: dict[str, Any], world: int) -> None:
    from lightning_llmpar.callbacks.throughput import ThroughputAndMemory, model_flops_per_token
    from tests.workloads import MODELS

    model = MODELS[name]()
    single = model_flops_per_token(model, seq_len=16)
    lookup = 0 if name == "llama_tied" else model.model.tok_emb.weight.numel()  # an untied input embedding's
    assert single == 6 * (sum(p.numel() for p in model.parameters()) - lookup) + 12 * 4 * 32 * 16
    outs = run_ranks(fit, world, name, kwargs, steps=4, batch_size=GLOBAL_BATCH,
                     callbacks_extra=[ThroughputAndMemory(log_every_n_steps=2, peak_flops=1e9)])
    # Rank 0 holds a part of the weights (half the blocks, each split in two) yet counts the model.
    assert outs[0]["extra"][0]["flops_per_token"] == single
    logged = outs[0]["logged"]
    assert logged["perf/mfu"] == pytest.approx(logged["perf/tflops_per_device"] * 1e12 / 1e9, rel=1e-5)


def test_compute_dtype_seen_by_throughput() -> None:
    from lightning.pytorch.plugins.precision import Precision

    from lightning_llmpar.callbacks.throughput import peak_flops_per_device
    from lightning_llmpar.precision.plugins import compute_dtype

    assert compute_dtype(BF16Precision()) == torch.bfloat16
    assert compute_dtype(FP16Precision()) == torch.float16
    assert compute_dtype(FP8Precision()) == torch.float8_e4m3fn
    assert compute_dtype(Precision()) == torch.float32
    assert peak_flops_per_device(torch.device("cpu"), torch.float32) is None  # no table for CPUs


def test_loss_scale_survives_checkpoint_resume(tmp_path: Any) -> None:
    path = str(tmp_path / "fp16.ckpt")
    fp16 = ("FP16Precision", {"init_scale": 1024.0})
    first = run_ranks(fit, 2, "gpt", {"zero_stage": 3}, steps=4, batch_size=8, precision=fp16, save_to=path,
                      callbacks_extra=[InjectInf(1, 1), StepRecorder()])
    assert first[0]["extra"][1]["scales"][-1] == 512.0
    resumed = run_ranks(fit, 2, "gpt", {"zero_stage": 3}, steps=6, batch_size=8, precision=fp16, ckpt_path=path,
                        callbacks_extra=[StepRecorder()])
    assert [o["extra"][0]["scales"] for o in resumed] == [[512.0, 512.0]] * 2


def test_fp8_rowwise_under_tensor_parallelism_is_refused_before_launch() -> None:
    # Rowwise scales are maxima along the dimension tensor parallelism splits: each rank's own would differ from
    # one process's (torchao's Float8Linear on a row split: 7.8e-3 off in the output, tensorwise 4.8e-7).
    from lightning.pytorch import Trainer

    from lightning_llmpar import LLMParallelStrategy

    with pytest.raises(ValueError, match=r"recipe='rowwise'\) with tensor_parallel=2: .*recipe='tensorwise'"):
        Trainer(accelerator="cpu", devices=2, strategy=LLMParallelStrategy(tensor_parallel=2),
                plugins=[FP8Precision(recipe="rowwise", **FP8_CPU)], logger=False)


def _fp8_at_dp2_tp2(folder: str) -> dict[str, Any]:
    """Tensorwise FP8 at dp2 x tp2 (ZeRO-3), weights gathered in bf16/fp32 and in fp8: 4 steps; and in fp8, 2 steps,
    saved, resumed for 2 more."""
    import os

    env = dict(os.environ)  # Lightning's cluster environment removes WORLD_SIZE at teardown
    # One epoch is 2 steps (16 samples): the resumed run starts an epoch, as the uninterrupted one does at step 3.
    layout, kwargs = {"tensor_parallel": 2, "zero_stage": 3}, {"batch_size": 4, "sgd": True, "samples": 16}
    gathered, plain = ("FP8Precision", FP8_CPU), ("FP8Precision", {**FP8_CPU, "float8_all_gather": False})
    runs = {}
    for name, precision, extra in [("plain", plain, {"steps": 4}), ("fp8", gathered, {"steps": 4}),
                                   ("first", gathered, {"steps": 2, "save_to": f"{folder}/step2"}),
                                   ("resumed", gathered, {"steps": 4, "ckpt_path": f"{folder}/step2"})]:
        os.environ.update(env)
        out = fit("gpt", layout, precision=precision, **extra, **kwargs)
        runs[name] = {"losses": out["losses"], "grads": out["grads"], "weights": out["plugin"]["fp8_weight_types"]}
    return runs


def test_fp8_weights_gathered_in_fp8_are_scaled_as_one_process_scales_them(tmp_path: Any) -> None:
    """FSDP gathers tensorwise FP8 weights cast with scales of the whole weight. Before the first step (and after a
    resume) none were computed, and torchao took each tensor-parallel shard's own amax: the first loss of a
    transformers Llama at dp2 x tp2 was 1.8e-4 off one process, where gathering unconverted weights is exact. So
    gathering in fp8 must change nothing: the same losses and gradients, rounding of the same values alike."""
    outs = run_ranks(_fp8_at_dp2_tp2, 4, str(tmp_path), timeout=900)
    assert outs[0]["fp8"]["weights"] == ["WeightWithDynamicFloat8CastTensor"]
    assert outs[0]["plain"]["weights"] == ["Tensor"]
    for out in outs:
        plain, fp8, resumed = out["plain"], out["fp8"], out["resumed"]
        assert max(abs(a - b) for a, b in zip(fp8["losses"], plain["losses"])) < 1e-6, (fp8["losses"], plain["losses"])
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(fp8["grads"][name], grad, atol=1e-7, rtol=1e-5, msg=f"grad {name}")
        # Resumed, the scales are computed again from the loaded weights: the uninterrupted run's next step. (Only
        # that one: Lightning restarts a checkpoint saved at the end of fit's last epoch one batch short, one
        # process alike.)
        assert abs(resumed["losses"][0] - fp8["losses"][2]) < 1e-6, (resumed["losses"], fp8["losses"])
