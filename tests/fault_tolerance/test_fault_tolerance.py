"""Killed ranks, half-written checkpoints, bad steps and diverged replicas, with real torchrun restarts."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llmpar.fault_tolerance.callbacks import checkpoint_problem, newest_complete_checkpoint
from lightning_llmpar.fault_tolerance.drill import STEPS, committed_samples, run_until_done
from lightning_llmpar.fault_tolerance.sampler import ResumableDistributedSampler
from tests.distributed import run_ranks

SAMPLES, STEPS_PER_EPOCH = 64, 8


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict]:
    out = tmp_path_factory.mktemp("reference")
    assert run_until_done(out, restarts=0) == 0
    return torch.load(out / "final.pt"), committed_samples(out)


def _assert_same_run(
    out: Path,
    reference: tuple[dict[str, torch.Tensor], dict],
    steps_per_epoch: int = STEPS_PER_EPOCH,
    data_ranks: tuple[int, ...] = (0, 1),
) -> None:
    weights, seen = reference
    final = torch.load(out / "final.pt")
    for name, value in weights.items():
        torch.testing.assert_close(final[name], value, atol=1e-6, rtol=0, msg=f"{name} differs from the uninterrupted run")
    committed = committed_samples(out)
    assert committed == seen, "the samples of some step differ from the uninterrupted run"
    first_epoch = sorted(
        i for (rank, step), ids in committed.items() if step < steps_per_epoch and rank in data_ranks for i in ids
    )
    if steps_per_epoch <= STEPS:
        assert first_epoch == list(range(SAMPLES)), "every sample of the epoch exactly once across data-parallel ranks"
    assert len(set(first_epoch)) == len(first_epoch), "a sample was trained on twice in one epoch"


TRIALS = [(trial, random.Random(trial).randint(1, STEPS - 2), trial % 2 == 1) for trial in range(3)]


@pytest.mark.parametrize(("trial", "kill_at", "in_save"), TRIALS, ids=[f"trial{t}" for t, _, _ in TRIALS])
def test_killed_rank_resumes_to_the_uninterrupted_result(
    tmp_path: Path, uninterrupted: tuple[dict[str, torch.Tensor], dict], trial: int, kill_at: int, in_save: bool
) -> None:
    failures = run_until_done(tmp_path, kill_at=-1 if in_save else kill_at, in_save=in_save)
    assert (tmp_path / "killed").exists() and failures == 1, "the fault was not injected"
    assert not any(p.name.endswith(".partial") for p in (tmp_path / "ckpt").iterdir()), "half-written checkpoint left"
    _assert_same_run(tmp_path, uninterrupted)


def test_dict_batches_resume_exactly_once(tmp_path: Path, uninterrupted: tuple[dict[str, torch.Tensor], dict]) -> None:
    # Dict batches (the position counts samples, not keys), the sampler left to Lightning's
    # use_distributed_sampler=True (kept, not wrapped, so its position is saved), throughput logged from dicts.
    assert run_until_done(tmp_path, kill_at=5, dict_batches=True) == 1
    _assert_same_run(tmp_path, uninterrupted)


def test_killed_pipeline_rank_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    pp = {"pipeline_parallel": 2, "pipeline_schedule": "1F1B"}
    ref = tmp_path / "reference"
    assert run_until_done(ref, restarts=0, strategy=pp) == 0
    out = tmp_path / "killed"
    assert run_until_done(out, kill_at=5, strategy=pp) == 1
    # One data-parallel rank: 64 samples / 4 per step = 16 steps an epoch; both pipeline ranks see the batch.
    _assert_same_run(out, (torch.load(ref / "final.pt"), committed_samples(ref)), steps_per_epoch=16, data_ranks=(0,))


def test_truncated_and_partial_checkpoints_are_skipped(tmp_path: Path, uninterrupted: Any) -> None:
    out = tmp_path / "run"
    assert run_until_done(out, restarts=0) == 0
    folder = out / "ckpt"
    newest, older = sorted(folder.iterdir(), key=lambda p: int(p.name.split("=")[1].split(".")[0]), reverse=True)
    assert newest_complete_checkpoint(folder) == newest
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert "truncated" in (checkpoint_problem(newest) or "")
    with pytest.warns(UserWarning, match=r"Skipping checkpoint .*step=12.ckpt: file .*distcp has \d+ bytes, expected \d+ \(truncated\)"):
        assert newest_complete_checkpoint(folder) == older
    shutil.copytree(older, folder / "step=99.ckpt")
    (folder / "step=99.ckpt" / "meta.pt").unlink()
    with pytest.warns(UserWarning, match=r"step=99.ckpt: file meta.pt is missing"):
        assert newest_complete_checkpoint(folder) == older


def test_sampler_resumes_each_sample_exactly_once_even_with_another_dp_size() -> None:
    data = list(range(40))
    full = [ResumableDistributedSampler(data, 2, r, seed=3) for r in range(2)]
    consumed = [list(iter(s))[:6] for s in full]  # 3 batches of 2 per rank
    state = {**full[0].state_dict(), "consumed": 12}
    rest = []
    for r in range(4):  # resume on 4 data-parallel ranks
        s = ResumableDistributedSampler(data, 4, r, seed=3)
        s.load_state_dict(state)
        rest += list(iter(s))
    assert sorted(consumed[0] + consumed[1] + rest) == data


def _guard_run(inject: str) -> dict[str, Any]:
    import os

    from lightning.pytorch import Callback, Trainer, seed_everything

    from lightning_llmpar import LLMParallelStrategy
    from lightning_llmpar.fault_tolerance.callbacks import StepGuard
    from tests.workloads import TokenData, make_gpt

    seed_everything(0, verbose=False)
    module = make_gpt()
    guard = StepGuard(check_replicas_every=2, max_consecutive_bad=2)
    rank = int(os.environ["RANK"])
    original = module.training_step

    def training_step(batch: Any, batch_idx: int) -> Any:
        loss = original(batch, batch_idx)
        step = module.trainer.global_step
        if inject == "inf" and step == 2 and rank == 1:
            return loss * float("inf")  # only one rank sees it
        if inject == "always_nan" and step >= 1:
            return loss * float("nan")
        return loss

    class Diverge(Callback):
        # After an update; pure data parallelism runs on DDP, whose parameters are plain tensors.
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            if inject == "diverge" and trainer.global_step == 3 and rank == 0:
                with torch.no_grad():
                    next(module.parameters()).add_(1e-2)

    module.training_step = training_step  # type: ignore[method-assign]
    trainer = Trainer(accelerator="cpu", devices=2, strategy=LLMParallelStrategy(zero_stage=0), max_steps=6,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, callbacks=[Diverge(), guard])
    try:
        trainer.fit(module, datamodule=TokenData(8))
    except RuntimeError as err:
        return {"error": str(err), "skipped": guard.skipped_steps}
    return {"error": None, "skipped": guard.skipped_steps, "steps": trainer.global_step}


def test_inf_on_one_rank_skips_the_same_step_everywhere() -> None:
    outs = run_ranks(_guard_run, 2, "inf")
    assert [o["skipped"] for o in outs] == [[2], [2]] and all(o["error"] is None for o in outs)


def test_repeated_bad_steps_stop_the_run() -> None:
    outs = run_ranks(_guard_run, 2, "always_nan")
    assert all("2 bad steps in a row" in o["error"] for o in outs)


def test_diverged_replica_is_caught() -> None:
    outs = run_ranks(_guard_run, 2, "diverge")
    assert all(o["error"] and "Replicas diverged" in o["error"] for o in outs)
