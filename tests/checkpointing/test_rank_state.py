"""A callback whose state differs by rank (an EMA of sharded weights, of one pipeline stage's weights) resumes
with every rank's own state, as one process's EMA continues; on another layout it is refused, not mixed up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from tests.distributed import run_ranks
from tests.workloads import fit, fit_error, full

GLOBAL_BATCH, SAMPLES = 16, 48  # 3 steps per epoch: the checkpoint falls on an epoch boundary


class EMA(Callback):
    """A hand-written EMA of the weights, as users write one: state is the module's own parameters (DTensor shards
    under ZeRO-3 and tensor parallelism; this stage's only under pipeline parallelism)."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.ema: dict[str, torch.Tensor] | None = None
        self.whole: list[Any] = []

    @torch.no_grad()
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self.ema is None:
            self.ema = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            return
        for n, p in pl_module.named_parameters():
            self.ema[n].lerp_(p.detach(), 1 - self.decay)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        mine = {n: full(t).cpu() for n, t in sorted((self.ema or {}).items())}  # collectives in one order
        gathered: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(gathered, mine)
        self.whole = sorted({n: t for part in gathered for n, t in part.items()}.items())

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema = state["ema"]


def ema_fit(kwargs: dict[str, Any] | None, dp: int, **fit_kwargs: Any) -> dict[str, torch.Tensor]:
    ema = EMA()
    fit("gpt", kwargs, sgd=True, batch_size=GLOBAL_BATCH // dp, samples=SAMPLES, callbacks_extra=[ema], **fit_kwargs)
    return dict(ema.whole)


def resume_error(kwargs: dict[str, Any], dp: int, path: str, with_ema: bool) -> str | None:
    return fit_error("gpt", kwargs, sgd=True, batch_size=GLOBAL_BATCH // dp, samples=SAMPLES, steps=6,
                     ckpt_path=path, callbacks_extra=[EMA()] if with_ema else [])


@pytest.fixture(scope="module")
def one_process_ema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Plain Lightning on one process, saving after epoch 0 and resuming from its own checkpoint file (Lightning's
    loops decide which batches follow a resume)."""
    path = str(tmp_path_factory.mktemp("plain") / "epoch0.ckpt")
    run_ranks(ema_fit, 1, None, 1, steps=-1, epochs=1, save_to=path)
    return run_ranks(ema_fit, 1, None, 1, steps=6, ckpt_path=path)[0]


@pytest.mark.parametrize(
    ("world", "kwargs", "dp"),
    [
        pytest.param(2, {"zero_stage": 3}, 2, id="zero3"),
        pytest.param(2, {"tensor_parallel": 2}, 1, id="tp2"),
        pytest.param(2, {"pipeline_parallel": 2}, 1, id="pp2"),
    ],
)
def test_a_callbacks_sharded_state_resumes_as_one_process_continues(
    one_process_ema: dict[str, torch.Tensor], world: int, kwargs: dict[str, Any], dp: int, tmp_path: Path
) -> None:
    path = str(tmp_path / "epoch0.ckpt")
    run_ranks(ema_fit, world, kwargs, dp, steps=-1, epochs=1, save_to=path)
    resumed = run_ranks(ema_fit, world, kwargs, dp, steps=6, ckpt_path=path)
    for ema in resumed:
        assert ema.keys() == one_process_ema.keys()
        worst = max(float((ema[n] - one_process_ema[n]).abs().max()) for n in ema)
        assert worst < 1e-5, worst
    assert sorted(p.name for p in (tmp_path / "epoch0.ckpt").glob("rank_state*.pt")) == [
        f"rank_state{r}.pt" for r in range(world)]


def test_sharded_callback_state_on_another_layout_is_refused_for_the_callback_that_reads_it(tmp_path: Path) -> None:
    path = str(tmp_path / "epoch0.ckpt")
    run_ranks(ema_fit, 2, {"tensor_parallel": 2}, 1, steps=-1, epochs=1, save_to=path)
    errors = run_ranks(resume_error, 2, {"zero_stage": 3}, 2, path, True)
    assert all(e is not None and "ValueError" in e and "callback EMA" in e for e in errors), errors
    assert "Resume as it was saved" in errors[0], errors[0]
    # Without the callback nobody reads that state: the run resumes.
    assert run_ranks(resume_error, 2, {"zero_stage": 3}, 2, path, False) == [None, None]


class AveragedEMA(Callback):
    """torch's AveragedModel over the module's model, made after the first step (a deep copy of the parallel model)."""

    def __init__(self) -> None:
        self.average: Any = None
        self.whole: list[Any] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

        if self.average is None:  # avg_fn: per parameter (multi_avg_fn's foreach cannot mix DTensors and tensors)
            self.average = AveragedModel(pl_module.model, avg_fn=get_ema_avg_fn(0.8))
        else:
            self.average.update_parameters(pl_module.model)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.whole = [(n, full(p).cpu()) for n, p in self.average.module.named_parameters()]


def averaged_fit(kwargs: dict[str, Any] | None, dp: int) -> dict[str, torch.Tensor]:
    ema = AveragedEMA()
    fit("gpt", kwargs, sgd=True, batch_size=GLOBAL_BATCH // dp, samples=SAMPLES, steps=4, callbacks_extra=[ema])
    return dict(ema.whole)


def test_an_averaged_model_of_the_tensor_parallel_model_averages_as_one_process() -> None:
    # The replicated weights' gradients were views of one buffer, which deepcopy (inside AveragedModel) refused.
    # (FSDP2 refuses deepcopy itself: under ZeRO-3 an EMA is kept as the EMA callback above keeps it.)
    (one,) = run_ranks(averaged_fit, 1, None, 1)
    for ema in run_ranks(averaged_fit, 2, {"tensor_parallel": 2}, 1):
        assert ema.keys() == one.keys()
        assert max(float((ema[n] - one[n]).abs().max()) for n in one) < 1e-5


class RunId(Callback):
    """Lightning's own patterns: an entry only rank 0 adds (a logger's run id), and a sparse tensor in a state."""

    def __init__(self) -> None:
        self.histogram = torch.sparse_coo_tensor([[0, 3]], [1.0, 2.0], (8,))
        self.loaded: list[Any] = []

    def state_dict(self) -> dict[str, Any]:
        return {"histogram": self.histogram}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(float(state["histogram"].to_dense().sum()))

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.is_global_zero:
            checkpoint["run_id"] = "run-1"

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self.loaded.append(checkpoint["run_id"])


def run_id_fit(kwargs: dict[str, Any], dp: int, **fit_kwargs: Any) -> list[Any]:
    run_id = RunId()
    fit("gpt", kwargs, sgd=True, batch_size=GLOBAL_BATCH // dp, samples=SAMPLES, callbacks_extra=[run_id], **fit_kwargs)
    return run_id.loaded


def test_an_entry_only_rank_zero_adds_and_a_sparse_state_resume_on_every_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "epoch0.ckpt")
    run_ranks(run_id_fit, 2, {"zero_stage": 3}, 2, steps=-1, epochs=1, save_to=path)
    assert run_ranks(run_id_fit, 2, {"zero_stage": 3}, 2, steps=4, ckpt_path=path) == [["run-1", 3.0]] * 2


def test_another_pipeline_schedule_is_another_layout_for_stage_local_state(tmp_path: Path) -> None:
    # pp2 under 1F1B holds blocks 0-1 on rank 0; interleaved, blocks 0 and 2: the saved EMAs are other blocks'.
    path = str(tmp_path / "epoch0.ckpt")
    run_ranks(ema_fit, 2, {"pipeline_parallel": 2, "pipeline_schedule": "1F1B"}, 1, steps=-1, epochs=1, save_to=path)
    errors = run_ranks(resume_error, 2, {"pipeline_parallel": 2}, 1, path, True)
    assert all(e is not None and "callback EMA" in e and "other parts of the model" in e for e in errors), errors


class NumpyState(Callback):
    """A state torch's safe loader refuses (a numpy array): resumable only when the checkpoints are trusted."""

    def __init__(self) -> None:
        self.loaded: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        import numpy as np

        return {"array": np.arange(4.0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(float(state["array"].sum()))


def trusted_fit(folder: str, steps: int, resume: bool) -> tuple[list[float], list[str]]:
    import warnings

    from lightning_llmpar.fault_tolerance.callbacks import FaultTolerantCheckpoint

    state = NumpyState()
    ftc = FaultTolerantCheckpoint(dirpath=folder, every_n_train_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit("gpt", {"zero_stage": 3, "checkpoint_weights_only": False}, sgd=True, batch_size=8, samples=SAMPLES,
            steps=steps, callbacks_extra=[ftc, state], ckpt_path="last" if resume else None)
    return state.loaded, [str(w.message) for w in caught if "Skipping" in str(w.message)]


def test_trusted_checkpoints_holding_what_the_safe_loader_refuses_are_found_by_the_resume_scan(tmp_path: Path) -> None:
    # The scan read meta.pt with the safe loader whatever the trust: every checkpoint was skipped as "not a checkpoint".
    run_ranks(trusted_fit, 2, str(tmp_path), 2, False)
    assert run_ranks(trusted_fit, 2, str(tmp_path), 4, True) == [([6.0], [])] * 2
