"""Checkpoints a multi-day run can trust: nothing read runs code, runs never prune or overwrite each other's
checkpoints, every instant of a save is crash-consistent, corruption is caught and resume falls back."""

from __future__ import annotations

import multiprocessing
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from lightning_llmpar import export_consolidated
from lightning_llmpar.checkpointing.manifest import MANIFEST
from lightning_llmpar.fault_tolerance.callbacks import checkpoint_problem, newest_complete_checkpoint
from tests.checkpointing.scenarios import Payload, resume_each, save_version, train
from tests.distributed import run_ranks

pytest.importorskip("transformers")

FTC = {"every_n_train_steps": 2, "keep_last": 5}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run's FaultTolerantCheckpoint folder: step=2, 4, 6, 8."""
    folder = tmp_path_factory.mktemp("run") / "ckpt"
    out = run_ranks(train, 1, steps=8, ftc={"dirpath": str(folder), **FTC})[0]
    assert out["error"] is None, out.get("traceback")
    assert sorted(p.name for p in folder.iterdir()) == [f"step={s}.ckpt" for s in (2, 4, 6, 8)]
    return folder


def _copy(first_run: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(first_run, folder)
    return folder


def test_fresh_run_into_another_runs_folder_is_refused_before_training(first_run: Path, tmp_path: Path) -> None:
    folder = _copy(first_run, tmp_path)
    before = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    out = run_ranks(train, 1, steps=4, ftc={"dirpath": str(folder), "every_n_train_steps": 2, "keep_last": 2})[0]
    assert out["error"] and out["error"].startswith("ValueError"), out
    assert str(folder) in out["error"] and "step=8.ckpt" in out["error"] and "ckpt_path='last'" in out["error"]
    assert out["steps"] == [], "it trained before refusing"
    assert {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_resumed_run_prunes_only_its_own_lineage(first_run: Path, tmp_path: Path) -> None:
    folder = _copy(first_run, tmp_path)
    out = run_ranks(train, 1, steps=2, ftc={"dirpath": str(tmp_path / "other"), **FTC})[0]
    assert out["error"] is None, out.get("traceback")
    shutil.copytree(tmp_path / "other" / "step=2.ckpt", folder / "step=1.ckpt")  # another run's, in the same folder
    out = run_ranks(train, 1, steps=12, ckpt_path="last", ftc={"dirpath": str(folder), "every_n_train_steps": 2,
                                                                 "keep_last": 2})[0]
    assert out["error"] is None, out.get("traceback")
    assert out["steps"][0] == 9, "did not resume from step=8"
    assert sorted(p.name for p in folder.iterdir()) == ["step=1.ckpt", "step=10.ckpt", "step=12.ckpt"]


def _plant(folder: Path, source: Path, name: str, marker: Path, file: str) -> None:
    planted = folder / name
    shutil.copytree(source, planted)
    (planted / MANIFEST).unlink(missing_ok=True)  # as if written before manifests: the files themselves are read
    payload = Payload(str(marker))
    if file == ".metadata":
        (planted / file).write_bytes(pickle.dumps(payload))
    else:
        torch.save({"state": payload}, planted / file)


@pytest.mark.parametrize("file", [".metadata", "meta.pt", "compression_rank0.pt", "rank_state0.pt"])
def test_planted_payload_never_runs_and_the_folder_is_skipped(first_run: Path, tmp_path: Path, file: str) -> None:
    folder = _copy(first_run, tmp_path)
    marker = tmp_path / "marker"
    _plant(folder, folder / "step=8.ckpt", "step=999.ckpt", marker, file)
    assert (problem := checkpoint_problem(folder / "step=999.ckpt")) and problem.startswith("not a checkpoint"), problem
    out = run_ranks(train, 1, steps=10, ckpt_path="last", ftc={"dirpath": str(folder), **FTC})[0]
    assert not marker.exists(), "the payload ran"
    assert out["error"] is None, out.get("traceback")
    assert out["steps"][0] == 9, "resume did not skip the planted folder for step=8"
    assert any("Skipping checkpoint" in w and "step=999.ckpt: not a checkpoint" in w for w in out["warnings"])
    with pytest.raises(ValueError, match="not a checkpoint"):
        export_consolidated(folder / "step=999.ckpt", tmp_path / "model.pt")
    out = run_ranks(train, 1, steps=10, ckpt_path=str(folder / "step=999.ckpt"))[0]
    assert out["error"] and "not a checkpoint" in out["error"] and out["steps"] == []
    assert not marker.exists(), "the payload ran"


def test_a_planted_file_under_one_of_its_own_names_is_named(first_run: Path, tmp_path: Path) -> None:
    # A plain pickle as `rank_state0.pt` was refused, but as "unreadable (RuntimeError: mmap can only be used with
    # files saved with torch.save...)", naming neither the file nor why; beside a manifest it was read at all.
    folder = _copy(first_run, tmp_path)
    marker = tmp_path / "marker"
    listed = folder / "step=998.ckpt"
    shutil.copytree(folder / "step=8.ckpt", listed)
    (listed / "rank_state0.pt").write_bytes(pickle.dumps(Payload(str(marker))))
    problem = checkpoint_problem(listed)
    assert problem and problem.startswith("rank_state0.pt is named like its own files but not in its manifest"), problem
    _plant(folder, folder / "step=8.ckpt", "step=999.ckpt", marker, "rank_state0.pt")
    (folder / "step=999.ckpt" / "rank_state0.pt").write_bytes(pickle.dumps(Payload(str(marker))))  # not torch.save's
    problem = checkpoint_problem(folder / "step=999.ckpt")
    assert problem and problem.startswith("rank_state0.pt is not a file torch.save wrote (RuntimeError"), problem
    assert not marker.exists(), "the payload ran"


def test_corrupted_newest_checkpoint_is_reported_and_resume_falls_back(first_run: Path, tmp_path: Path) -> None:
    folder = _copy(first_run, tmp_path)
    shard = next((folder / "step=8.ckpt").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of the weights
    shard.write_bytes(bytes(data))
    problem = checkpoint_problem(folder / "step=8.ckpt")
    assert problem and f"file {shard.name} has CRC-32" in problem and "expected" in problem, problem
    out = run_ranks(train, 1, steps=10, ckpt_path=str(folder / "step=8.ckpt"))[0]  # by path: refused
    assert out["error"] and "corrupted" in out["error"] and out["steps"] == []
    out = run_ranks(train, 1, steps=10, ckpt_path="last", ftc={"dirpath": str(folder), **FTC})[0]
    assert out["error"] is None, out.get("traceback")
    assert out["steps"][0] == 7, "resume did not fall back to step=6"
    assert any(f"step=8.ckpt: file {shard.name} has CRC-32" in w for w in out["warnings"])
    assert any("Resuming from" in w and "step=6.ckpt" in w for w in out["warnings"])
    assert checkpoint_problem(folder / "step=8.ckpt") is None, "the resumed run saves step=8 again, intact"


def test_another_backends_checkpoint_is_skipped_on_resume(first_run: Path, tmp_path: Path) -> None:
    # A DeepSpeed checkpoint (sharding_backend='deepspeed', here as written before manifests) in the folder of an
    # FSDP2 run: "last" took it, as the newest complete one, and then failed to read it.
    folder = _copy(first_run, tmp_path)
    (folder / "step=999.ckpt" / "ckpt").mkdir(parents=True)
    (folder / "step=999.ckpt" / "ckpt" / "mp_rank_00_model_states.pt").write_bytes(b"not read")
    out = run_ranks(train, 1, steps=10, ckpt_path="last", ftc={"dirpath": str(folder), **FTC})[0]
    assert out["error"] is None, out.get("traceback")
    assert out["steps"][0] == 9, "resume did not skip the other backend's checkpoint for step=8"
    assert any("step=999.ckpt: sharding_backend='deepspeed' wrote it" in w for w in out["warnings"]), out["warnings"]
    out = run_ranks(train, 1, steps=10, ckpt_path=str(folder / "step=999.ckpt"))[0]  # by path: refused, with why
    assert out["error"] and "sharding_backend='fsdp2' cannot read" in out["error"] and out["steps"] == []


def test_leftover_old_folder_does_not_break_later_saves(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    assert run_ranks(train, 1, steps=1, save_ckpt=str(path))[0]["error"] is None
    shutil.copytree(path, tmp_path / ".model.ckpt.old")  # left by a save interrupted before its last step
    out = run_ranks(train, 1, steps=2, save_ckpt=str(path))[0]
    assert out["error"] is None, out.get("traceback")
    assert checkpoint_problem(path) is None and not (tmp_path / ".model.ckpt.old").exists()


@pytest.mark.parametrize("leftover", ["partial", "old"])
def test_crash_between_the_renames_resumes_from_the_complete_copy(
    first_run: Path, tmp_path: Path, leftover: str
) -> None:
    folder = _copy(first_run, tmp_path)
    # Between the renames: the new copy complete in .partial (previous already moved to .old), or only .old.
    (folder / "step=8.ckpt").rename(folder / f".step=8.ckpt.{leftover}")
    assert newest_complete_checkpoint(folder) == folder / "step=8.ckpt"
    out = run_ranks(train, 1, steps=10, ckpt_path="last", ftc={"dirpath": str(folder), **FTC})[0]
    assert out["error"] is None and out["steps"][0] == 9, out


def test_lightnings_model_checkpoint_killed_between_the_renames_is_put_back_not_replaced(tmp_path: Path) -> None:
    # Lightning's scan for ckpt_path="last" does not see .last.ckpt.partial: the run trained from step 0 and its
    # first save replaced the put-back last.ckpt (12 trained steps lost, exit status 0).
    every = {"dirpath": str(tmp_path), "every_n_train_steps": 2, "save_last": True, "save_top_k": 0}
    assert run_ranks(train, 1, steps=4, model_checkpoint=every)[0]["error"] is None
    (tmp_path / "last.ckpt").rename(tmp_path / ".last.ckpt.partial")  # the new copy complete, not yet in place
    refused = run_ranks(train, 1, steps=6, ckpt_path="last", model_checkpoint=every)[0]
    assert "Run again with ckpt_path='last'" in (refused["error"] or "") and refused["steps"] == [], refused
    assert checkpoint_problem(tmp_path / "last.ckpt") is None  # back in place
    out = run_ranks(train, 1, steps=6, ckpt_path="last", model_checkpoint=every)[0]
    assert out["error"] is None and out["steps"] == [5, 6], out


def _killed_save(path: Path, kill_at: int) -> int | None:
    # The launcher's forkserver (one per process), which has torch and this library imported already.
    proc = multiprocessing.get_context("forkserver").Process(target=save_version, args=(str(path), 2, kill_at))
    proc.start()
    proc.join(120)
    return proc.exitcode


def test_kill_at_every_file_operation_of_a_save_leaves_a_resumable_checkpoint(tmp_path: Path) -> None:
    pristine = tmp_path / "pristine"  # version 1 complete; version 2 is saved over it (as a resumed run re-saves)
    run_ranks(save_version, 1, str(pristine / "step=5.ckpt"), 1)
    shutil.copytree(pristine, tmp_path / "count")
    operations = run_ranks(save_version, 1, str(tmp_path / "count" / "step=5.ckpt"), 2)[0]
    assert operations >= 8, operations
    folders = []
    for kill_at in range(1, operations + 1):
        folder = tmp_path / f"kill{kill_at}"
        shutil.copytree(pristine, folder)
        assert _killed_save(folder / "step=5.ckpt", kill_at) == 9, f"not killed at operation {kill_at}"
        folders.append(str(folder))
    found = run_ranks(resume_each, 1, folders, False)[0]
    for kill_at, result in enumerate(found, start=1):
        assert result["found"] == "step=5.ckpt", f"killed at operation {kill_at} of {operations}: nothing to resume"
        assert result["weights"] == [result["meta"]], f"killed at operation {kill_at}: a mix of versions {result}"
    assert found[0]["meta"] == 1 and {r["meta"] for r in found} == {1, 2}, found
    # Whatever a crash left, the next save to that name succeeds and is what resume finds.
    assert all(r["meta"] == 2 for r in run_ranks(resume_each, 1, folders, True)[0])


def test_a_one_file_checkpoint_is_refused_with_the_way_to_its_weights(tmp_path: Path) -> None:
    # A Lightning .ckpt file given as ckpt_path was refused as "not a folder", naming no way to use its weights.
    file = tmp_path / "epoch=0-step=10.ckpt"
    file.write_bytes(b"not read")
    problem = checkpoint_problem(file)
    assert problem is not None and "one-file checkpoint" in problem and "load_from_checkpoint" in problem, problem
    assert file.read_bytes() == b"not read"
