"""Pipeline parallelism inside Lightning's loop reproduces one process, alone and composed into 3D."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_llmpar.pipeline.stages import StageLayout, plan_stages
from tests.distributed import run_ranks
from tests.test_parity import GLOBAL_BATCH, reference_for
from tests.workloads import fit

LOSS_TOL, GRAD_TOL, PARAM_TOL = 1e-5, 1e-5, 5e-4


def _run(model: str, kwargs: dict[str, Any], world: int, **fit_kwargs: Any) -> list[dict[str, Any]]:
    dp = world // kwargs.get("tensor_parallel", 1) // kwargs.get("pipeline_parallel", 1)
    return run_ranks(fit, world, model, kwargs, batch_size=GLOBAL_BATCH // dp, **fit_kwargs)


def assert_pipeline_parity(ref: dict[str, Any], outs: list[dict[str, Any]]) -> None:
    """Every rank reports the broadcast step loss; gradients and weights are merged over the stages."""
    steps = len(ref["losses"])
    assert steps >= 10
    for i in range(steps):
        loss = sum(o["losses"][i] for o in outs) / len(outs)
        assert abs(loss - ref["losses"][i]) < LOSS_TOL, f"step {i}: {loss} vs {ref['losses'][i]}"
    grads: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    for out in outs:
        grads.update(out["grads"])
        params.update(out["params"])
    assert sorted(grads) == sorted(ref["grads"]), "every parameter must get a gradient on some stage"
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(grads[name], grad, atol=GRAD_TOL, rtol=0, msg=f"grad {name}")
    for name, param in ref["params"].items():
        torch.testing.assert_close(params[name], param, atol=PARAM_TOL, rtol=0, msg=f"param {name}")
    # Each pipeline rank holds only its stages' parameters.
    assert all(len(o["params"]) < len(ref["params"]) for o in outs)


SCHEDULES = ["Interleaved1F1B", "GPipe", "1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_every_schedule_matches_single_process(schedule: str) -> None:
    outs = _run("gpt", {"pipeline_parallel": 2, "pipeline_schedule": schedule}, 2)
    assert_pipeline_parity(reference_for("gpt"), outs)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_schedules_validate_between_steps(schedule: str) -> None:
    """A V's evaluation runs the forward half of its own program (torch's eval ran the backward hand-over between
    a rank's two stages too, and failed); validation every 2 steps and after fit equal one process's."""
    kwargs = {"validate": True, "val_every": 2}
    ref = reference_for("gpt", **kwargs)
    outs = _run("gpt", {"pipeline_parallel": 2, "pipeline_schedule": schedule}, 2, **kwargs)
    assert_pipeline_parity(ref, outs)
    for out in outs:
        for key, value in ref["val"].items():
            # (perplexity is exp(loss): 1e-5 on a loss near 3.8 is 4.6e-4 on its 46, so it is compared relatively)
            assert out["val"][key] == pytest.approx(value, abs=1e-5, rel=1e-6), (key, out["val"][key], value)


LAYOUTS_3D = [
    pytest.param({"pipeline_parallel": 2, "tensor_parallel": 2}, 4, id="pp2-tp2"),
    pytest.param({"pipeline_parallel": 2, "zero_stage": 1}, 4, id="pp2-dp2-zero1"),
    pytest.param({"pipeline_parallel": 2, "zero_stage": 3}, 4, id="pp2-dp2-zero3"),
    pytest.param({"pipeline_parallel": 2, "zero_stage": 2, "pipeline_schedule": "ZBVZeroBubble"}, 4, id="pp2-dp2-zero2-zbv"),
    pytest.param({"pipeline_parallel": 2, "tensor_parallel": 2, "zero_stage": 3}, 8, id="dp2-tp2-pp2"),
]


@pytest.mark.parametrize(("kwargs", "world"), LAYOUTS_3D)
def test_pipeline_composes_with_tp_and_zero(kwargs: dict[str, Any], world: int) -> None:
    assert_pipeline_parity(reference_for("gpt"), _run("gpt", kwargs, world))


@pytest.mark.parametrize(
    ("kwargs", "world"),
    [pytest.param({"pipeline_parallel": 2}, 2, id="pp2"),
     pytest.param({"pipeline_parallel": 2, "zero_stage": 3}, 4, id="pp2-dp2-zero3")],
)
def test_transformers_llama_pipeline_without_any_hook(kwargs: dict[str, Any], world: int) -> None:
    pytest.importorskip("transformers")
    outs = _run("llama", kwargs, world)
    assert_pipeline_parity(reference_for("llama"), outs)
    # The loss logged with sync_dist=True in training_step is the broadcast last-stage loss on every rank.
    for out in outs:
        assert abs(out["logged"]["train_loss"] - reference_for("llama")["logged"]["train_loss"]) < LOSS_TOL


@pytest.mark.parametrize(
    ("kwargs", "world"),
    [pytest.param({"pipeline_parallel": 2, "zero_stage": 3}, 4, id="pp2-dp2-zero3"),
     # One stage per rank: the schedule leaves the stage unsharded after a micro-step's backward (it trained on a
     # wrong gradient, this rank's unreduced one for the first micro-step, before the stage was resharded there).
     pytest.param({"pipeline_parallel": 2, "zero_stage": 2, "pipeline_schedule": "1F1B"}, 4, id="pp2-dp2-zero2-1f1b"),
     pytest.param({"pipeline_parallel": 2, "tensor_parallel": 2}, 4, id="pp2-tp2")],
)
def test_pipeline_accumulation_and_global_clipping(kwargs: dict[str, Any], world: int) -> None:
    ref = reference_for("gpt", accumulate=2, clip=0.1, sgd=True)
    assert_pipeline_parity(ref, _run("gpt", kwargs, world, accumulate=2, clip=0.1, sgd=True))


class ReductionCounter(Callback):
    """Gradient reductions (FSDP2 reduce-scatter / all-reduce of one unit) between optimizer steps, per step."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self.stages = 0
        self._count = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

        original = group.foreach_reduce

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._count += 1
            return original(*args, **kwargs)

        group.foreach_reduce = counted
        self.stages = len(trainer.strategy.pipeline_runner.stage_modules)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.per_step.append(self._count)
        self._count = 0


def test_accumulation_reduces_gradients_once_per_optimizer_step() -> None:
    """torch's schedules reduce gradients at the end of every schedule step; with accumulate_grad_batches=2 the
    first micro-step keeps them unreduced, so each stage's unit reduces once per optimizer step."""
    outs = _run("gpt", {"pipeline_parallel": 2, "zero_stage": 2}, 4, steps=4, accumulate=2, sgd=True,
                callbacks_extra=[ReductionCounter()])
    for out in outs:
        counter = out["extra"][0]
        assert counter["stages"] == 2 and counter["per_step"] == [counter["stages"]] * 4, counter


def test_validation_and_predict_run_through_the_schedule() -> None:
    ref = reference_for("gpt", validate=True, predict=True)
    outs = _run("gpt", {"pipeline_parallel": 2}, 2, validate=True, predict=True)
    for out in outs:
        for key in ("val/loss", "val/ppl"):
            assert abs(out["val"][key] - ref["val"][key]) < 1e-4, (key, out["val"][key], ref["val"][key])
        # Predictions come from the last stage and reach every rank.
        assert torch.equal(out["predictions"], ref["predictions"])


class _StepCalls(Callback):
    """Counts the module's validation_step calls, and the samples of those the documented guard keeps."""

    def __init__(self) -> None:
        self.calls = self.kept_samples = 0

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        runner, step = getattr(trainer.strategy, "pipeline_runner", None), pl_module.validation_step

        def counted(batch: Any, *args: Any) -> Any:
            self.calls += 1
            if runner is None or runner.counting:
                self.kept_samples += len(torch.utils._pytree.tree_leaves(batch)[0])
            return step(batch, *args)

        pl_module.validation_step = counted  # type: ignore[method-assign]


def test_state_a_step_keeps_itself_is_counted_once_with_the_documented_guard() -> None:
    # validation_step runs per microbatch on every stage and once on placeholders: a user's own list of losses
    # grew by 9 a validation instead of 2. While the runner says it is counting, each sample comes once (interleaved:
    # the last rank holds a middle stage too).
    ref = run_ranks(fit, 1, "gpt", None, batch_size=GLOBAL_BATCH, validate=True, callbacks_extra=[_StepCalls()])[0]
    outs = _run("gpt", {"pipeline_parallel": 2}, 2, validate=True, callbacks_extra=[_StepCalls()])
    seen = ref["extra"][0]["kept_samples"]
    assert seen > 0 and [o["extra"][0]["kept_samples"] for o in outs] == [0, seen]
    assert outs[1]["extra"][0]["calls"] > ref["extra"][0]["calls"]  # microbatches and the placeholder run


@pytest.mark.parametrize(("layout", "world", "samples"), [
    pytest.param({"pipeline_schedule": "Interleaved1F1B"}, 2, 54, id="Interleaved1F1B"),
    pytest.param({"pipeline_schedule": "1F1B"}, 2, 52, id="1F1B"),
    pytest.param({"zero_stage": 3}, 4, 54, id="dp2-zero3"),
])
def test_training_after_validation_and_short_batches_matches_one_process(layout: dict[str, Any], world: int,
                                                                         samples: int) -> None:
    """Validation every 5 steps and epochs of 54 samples (the last batch 6 of 16: 3 microbatches, not 4) or 52 (the
    last batch 4: 4 microbatches of 1, not of 4) over 3 epochs: the schedules for training, evaluation and the short
    batch take turns on the same stages, and training goes on exact."""
    kw: dict[str, Any] = {"steps": -1, "epochs": 3, "samples": samples, "sgd": True, "val_every": 5,
                          "val_batch_size": GLOBAL_BATCH}  # each data-parallel rank validates the whole batch
    ref = reference_for("gpt", **kw)
    outs = _run("gpt", {"pipeline_parallel": 2, **layout}, world, **kw)
    assert len(ref["losses"]) == 12
    assert_pipeline_parity(ref, outs)
    for out in outs:  # the last validation, after 10 steps
        assert abs(out["logged"]["val/loss"] - ref["logged"]["val/loss"]) < LOSS_TOL


def test_checkpoint_moves_between_pipeline_and_one_process(tmp_path: Path) -> None:
    samples = 80  # 5 steps an epoch: save at the epoch boundary
    pp = {"pipeline_parallel": 2}
    run = lambda world, kw, **k: run_ranks(fit, world, "gpt", kw, batch_size=GLOBAL_BATCH, samples=samples, **k)  # noqa: E731
    run(2, pp, steps=-1, epochs=1, save_to=str(tmp_path / "pp.ckpt"))
    run(1, {}, steps=-1, epochs=1, save_to=str(tmp_path / "one.ckpt"))
    plain_path = tmp_path / "plain.ckpt"
    run(1, None, steps=-1, epochs=1, save_to=str(plain_path))
    plain = run(1, None, steps=10, ckpt_path=str(plain_path))[0]
    from_pp = run(1, {}, steps=10, ckpt_path=str(tmp_path / "pp.ckpt"))
    to_pp = run(2, pp, steps=10, ckpt_path=str(tmp_path / "one.ckpt"))
    for outs in (from_pp, to_pp):
        for i in range(5):
            loss = sum(o["losses"][i] for o in outs) / len(outs)
            assert abs(loss - plain["losses"][i]) < LOSS_TOL, (i, loss, plain["losses"][i])
        merged: dict[str, torch.Tensor] = {}
        for o in outs:
            merged.update(o["params"])
        for name, param in plain["params"].items():
            torch.testing.assert_close(merged[name], param, atol=PARAM_TOL, rtol=0)


def test_stage_split_balances_parameters_and_honours_split_points() -> None:
    # Embedding (first) and head (last) are as heavy as two blocks: those stages get fewer blocks.
    ranges = plan_stages([10] * 8, 4, first_extra=20, last_extra=20)
    assert ranges == ((0, 1), (1, 4), (4, 7), (7, 8))
    assert plan_stages([10] * 8, 4, split_points=[2, 4, 6]) == ((0, 2), (2, 4), (4, 6), (6, 8))
    with pytest.raises(ValueError, match=r"The model has 3 blocks but the pipeline needs 4 stages"):
        plan_stages([1, 1, 1], 4)
    with pytest.raises(ValueError, match=r"pipeline_split_points=\[4, 2, 6\] must be 3 strictly increasing"):
        plan_stages([1] * 8, 4, split_points=[4, 2, 6])
    interleaved = StageLayout(pp=2, stages_per_rank=2, v_shape=False, block_ranges=ranges)
    assert interleaved.stages_of(0) == [0, 2] and interleaved.stages_of(1) == [1, 3]
    v_shape = StageLayout(pp=2, stages_per_rank=2, v_shape=True, block_ranges=ranges)
    assert v_shape.stages_of(0) == [0, 3] and v_shape.stages_of(1) == [1, 2]


def test_batch_not_divisible_by_microbatches_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"Batch size 16 is not divisible by pipeline_microbatches=3"):
        run_ranks(fit, 2, "gpt", {"pipeline_parallel": 2, "pipeline_schedule": "1F1B", "pipeline_microbatches": 3},
                  batch_size=16, steps=1)
