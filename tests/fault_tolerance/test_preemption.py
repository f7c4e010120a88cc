"""A SIGTERM (a scheduler's preemption notice) stops every rank at one step, saved, and the resumed run is exact.

The signal comes from a timer in each rank, so it lands wherever that rank is: mid-step, in a collective, while a
background save is written. Lightning's own handler joins a broadcast inside the signal handler; with the ranks
signalled 40 ms apart that met training's collectives and hung the job until the process-group timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from lightning_llmpar.checkpointing.dcp import read_meta
from lightning_llmpar.fault_tolerance.callbacks import checkpoint_problem, newest_complete_checkpoint
from lightning_llmpar.fault_tolerance.drill import STEPS, committed_samples, run_until_done, train
from tests.distributed import run_ranks
from tests.fault_tolerance.test_fault_tolerance import _assert_same_run

CASES = {
    # (step, rank 0's delay, rank 1's delay): seconds after that step's batch reached the module
    "both_ranks_40ms_apart": ({"zero_stage": 3}, (4, 0.01, 0.05)),
    "one_rank_async_save": ({"zero_stage": 3, "async_checkpoint": True}, (4, -1, 0.02)),
    # In the module's on_train_start: Lightning's handlers are registered, the first step has not begun. Deferring
    # from the first step only left this window (and the sanity check) to Lightning's: a gloo size-mismatch crash.
    "before_the_first_step": ({"zero_stage": 3}, (-1, 0.0, 0.04)),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict]:
    out = tmp_path_factory.mktemp("reference")
    assert run_until_done(out, restarts=0) == 0
    return torch.load(out / "final.pt"), committed_samples(out)


def _steps_run(out: Path, rank: int) -> list[int]:
    return [json.loads(line)["step"] for line in (out / f"seen_rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("case", list(CASES))
def test_sigterm_stops_every_rank_at_one_saved_step_and_the_run_resumes_exactly(
    tmp_path: Path, uninterrupted: tuple[dict[str, torch.Tensor], dict], case: str
) -> None:
    strategy, preempt = CASES[case]
    start = time.monotonic()
    # A 30-minute process-group timeout, as by default: a hang fails the launch's own 150 s limit.
    with pytest.raises(RuntimeError) as stopped:
        run_ranks(train, 2, tmp_path, STEPS, -1, False, strategy, 1800.0, 5, False, preempt, timeout=150)
    seconds = time.monotonic() - start
    assert str(stopped.value).count("exceptions.SIGTERMException\n") == 2, str(stopped.value)[-3000:]
    assert seconds < 60, f"the preempted run took {seconds:.0f} s to stop"
    stop = _steps_run(tmp_path, 0)[-1] + 1  # steps completed when every rank stopped
    assert _steps_run(tmp_path, 1)[-1] + 1 == stop, "the ranks stopped at different steps"
    assert preempt[0] < stop < STEPS and stop % 5 != 0, f"stopped after step {stop}, not one saved periodically"
    newest = newest_complete_checkpoint(tmp_path / "ckpt")
    assert newest is not None and newest.name == f"step={stop}.ckpt" and checkpoint_problem(newest) is None
    assert not any(p.name.startswith(".") for p in (tmp_path / "ckpt").iterdir()), "a staging folder was left"

    assert run_until_done(tmp_path, restarts=0, strategy=strategy, save_every=5) == 0
    for rank in (0, 1):
        assert _steps_run(tmp_path, rank) == list(range(STEPS)), "a step was lost or run twice"
    _assert_same_run(tmp_path, uninterrupted)


_SCONTROL = """#!/bin/sh
# scontrol as the requeue calls it: notes its arguments and the run folder's entries at that moment
out="$(dirname "$0")/.."
{ echo "$@"; ls -a "$out"; } > "$out/scontrol.log"
"""


def _under_slurm(out: Path, strategy: dict, preempt: tuple[float, ...]) -> int:
    rank = os.environ["RANK"]  # the launcher's rank, given to SLURM's variables as srun would
    os.environ.update(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NAME="drill", SLURM_JOB_ID="4242",
                      SLURM_PROCID=rank, SLURM_LOCALID=rank, SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1",
                      PATH=f"{out / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return train(out, STEPS, -1, False, strategy, 1800.0, 5, False, preempt, requeue=True)


def test_slurm_requeue_signal_saves_one_step_on_every_rank_before_the_requeue(
    tmp_path: Path, uninterrupted: tuple[dict[str, torch.Tensor], dict]
) -> None:
    # SLURM's requeue signal (SIGUSR1, `#SBATCH --signal=SIGUSR1@90`), 40 ms apart: Lightning's handler saves
    # hpc_ckpt_1.ckpt on every rank wherever the signal found it, a save's collectives against training's (a hang
    # until the process-group timeout). With background saves, the save is committed before scontrol runs.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "scontrol").write_text(_SCONTROL)
    (tmp_path / "bin" / "scontrol").chmod(0o755)
    strategy = {"zero_stage": 3, "async_checkpoint": True}
    assert run_ranks(_under_slurm, 2, tmp_path, strategy, (4, 0.01, 0.05), timeout=150) == [STEPS, STEPS]
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    assert checkpoint_problem(hpc) is None
    saved_at = read_meta(hpc)["global_step"]
    assert 4 < saved_at <= 6, f"the requeue's checkpoint holds step {saved_at}"
    call, *entries = (tmp_path / "scontrol.log").read_text().splitlines()  # the requeue, called once, by rank 0
    assert call == "requeue 4242"
    assert "hpc_ckpt_1.ckpt" in entries and not any(e.startswith(".hpc") for e in entries), entries

    # The requeued job: Lightning resumes from the newest hpc_ckpt (ckpt_path=None under SLURM), and ends as the
    # run that was never signalled.
    shutil.rmtree(tmp_path / "ckpt")  # the periodic checkpoints: this resume is the requeue's alone
    assert run_ranks(_under_slurm, 2, tmp_path, strategy, (), timeout=150) == [STEPS, STEPS]
    for rank in (0, 1):
        steps = _steps_run(tmp_path, rank)
        assert steps == list(range(STEPS)) + list(range(saved_at, STEPS)), "the resume did not start at the saved step"
    _assert_same_run(tmp_path, uninterrupted)
