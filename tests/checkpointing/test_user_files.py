"""Nothing written deletes what the run did not write (through the public API, one process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_llmpar.checkpointing.manifest import MANIFEST
from tests.checkpointing.scenarios import logits, save_pretrained_llama, train
from tests.distributed import run_ranks

pytest.importorskip("transformers")


def _user_files(folder: Path) -> dict[str, bytes]:
    (folder / "data").mkdir(parents=True, exist_ok=True)
    files = {"tokenizer.json": b'{"version": "1.0"}', "README.md": b"# my model\n", "data/train.txt": b"hello\n"}
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return files


def test_save_hf_checkpoint_into_a_folder_keeps_the_users_files(tmp_path: Path) -> None:
    model = tmp_path / "model"
    before = _user_files(model)
    for _ in range(2):  # the second export replaces the first one's files
        out = run_ranks(train, 1, steps=2, save_hf=str(model), hf_export={"dirpath": str(tmp_path / "clean")})[0]
        assert out["error"] is None, out.get("traceback")
        for name, content in before.items():
            assert (model / name).read_bytes() == content, f"{name} was deleted or changed"
    manifest = json.loads((model / MANIFEST).read_text())
    assert "model.safetensors" in manifest["files"] and "tokenizer.json" not in manifest["files"]
    ours, clean = run_ranks(logits, 1, str(model))[0], run_ranks(logits, 1, str(tmp_path / "clean" / "final"))[0]
    torch.testing.assert_close(ours, clean, atol=0, rtol=0)


def test_save_hf_checkpoint_into_the_pretrained_folder_is_refused(tmp_path: Path) -> None:
    # It replaced the weights and generation config the run started from (save_pretrained wrote them, not it).
    model = tmp_path / "model"
    run_ranks(save_pretrained_llama, 1, str(model))
    _user_files(model)
    before = {str(p.relative_to(model)): p.read_bytes() for p in model.rglob("*") if p.is_file()}
    out = run_ranks(train, 1, steps=1, hf_checkpoint=str(model), save_hf=str(model))[0]
    assert out["error"] and "model.safetensors" in out["error"] and "would replace and did not write" in out["error"]
    assert {str(p.relative_to(model)): p.read_bytes() for p in model.rglob("*") if p.is_file()} == before


def test_save_hf_checkpoint_refuses_weights_it_would_leave_stale(tmp_path: Path) -> None:
    model = tmp_path / "model"
    run_ranks(save_pretrained_llama, 1, str(model), shards=True)  # model-0000k-of-0000n + index, not ours
    for name in ("config.json", "generation_config.json"):  # files it would replace are refused first
        (model / name).unlink()
    shards = sorted(p.name for p in model.iterdir())
    out = run_ranks(train, 1, steps=1, save_hf=str(model))[0]
    assert out["error"] and "weight files this export would neither write nor replace" in out["error"]
    assert sorted(p.name for p in model.iterdir()) == shards, "the refused export changed the folder"


def test_hf_export_final_goes_beside_the_step_exports(tmp_path: Path) -> None:
    out = run_ranks(train, 1, steps=3, hf_export={"dirpath": str(tmp_path), "every_n_train_steps": 1})[0]
    assert out["error"] is None, out.get("traceback")
    for name in ("step=1", "step=2", "step=3", "final"):
        assert (tmp_path / name / "model.safetensors").is_file(), f"{name} export missing"
    torch.testing.assert_close(run_ranks(logits, 1, str(tmp_path / "step=3"))[0],
                               run_ranks(logits, 1, str(tmp_path / "final"))[0], atol=0, rtol=0)


def test_save_checkpoint_onto_a_folder_with_user_files_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    before = _user_files(target)
    out = run_ranks(train, 1, steps=1, save_ckpt=str(target))[0]
    assert out["error"] and out["error"].startswith("ValueError") and "README.md" in out["error"], out["error"]
    assert {n: (target / n).read_bytes() for n in before} == before
    assert not any(p.name.startswith(".ckpt") for p in tmp_path.iterdir()), "a staging folder was left"


@pytest.mark.parametrize("save_last", ["link", True])
def test_last_checkpoint_onto_a_users_folder_is_refused_before_training(tmp_path: Path, save_last: str | bool) -> None:
    # Lightning's save_last="link" deletes whatever `last.ckpt` holds to put its link there (version counter off);
    # save_last=True was refused only at its first save, after the steps before it had trained.
    before = _user_files(tmp_path / "last.ckpt")
    last = {"dirpath": str(tmp_path), "save_last": save_last, "enable_version_counter": False, "every_n_train_steps": 1}
    out = run_ranks(train, 1, steps=2, model_checkpoint=last)[0]
    assert out["error"] and out["error"].startswith("ValueError") and "last.ckpt" in out["error"], out["error"]
    assert out["steps"] == [], "refused after training"
    assert {n: (tmp_path / "last.ckpt" / n).read_bytes() for n in before} == before
    (tmp_path / "last.ckpt").rename(tmp_path / "mine")  # moved away, as the error says: the checkpoint is made
    out = run_ranks(train, 1, steps=2, model_checkpoint=last)[0]
    assert out["error"] is None and (tmp_path / "last.ckpt").is_symlink() == (save_last == "link"), out["error"]


def test_save_checkpoint_twice_and_tilde_paths(tmp_path: Path) -> None:
    # A checkpoint of ours is replaced; '~' is expanded.
    out = run_ranks(train, 1, steps=1, save_ckpt="~/ckpts/a.ckpt", save_hf="~/hf", home=str(tmp_path))[0]
    assert out["error"] is None, out.get("traceback")
    assert (tmp_path / "ckpts" / "a.ckpt" / MANIFEST).is_file() and (tmp_path / "hf" / MANIFEST).is_file()
    out = run_ranks(train, 1, steps=2, save_ckpt=str(tmp_path / "ckpts" / "a.ckpt"))[0]
    assert out["error"] is None, out.get("traceback")


def _export_and_log_every_3_steps(folder: str) -> list[int]:
    """5 batches an epoch in groups of 2, 2 epochs: steps after batches 2, 4, 5 of each (6 steps)."""
    import csv

    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from lightning_llmpar import LLMParallelStrategy
    from lightning_llmpar.callbacks.throughput import ThroughputAndMemory
    from lightning_llmpar.checkpointing.hf_checkpoint import HFCheckpointExport
    from tests.zoo import DictTokenData, HFCausalLM

    trainer = Trainer(accelerator="cpu", devices=1, strategy=LLMParallelStrategy(), max_epochs=2,
                      accumulate_grad_batches=2, logger=CSVLogger(folder, name="logs"), log_every_n_steps=1,
                      enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                      callbacks=[HFCheckpointExport(f"{folder}/hf", every_n_train_steps=3),
                                 ThroughputAndMemory(log_every_n_steps=3, peak_flops=1e9)])
    trainer.fit(HFCausalLM("llama"), datamodule=DictTokenData(2, n=10))
    assert trainer.global_step == 6
    with open(next(Path(folder, "logs").rglob("metrics.csv"))) as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("perf/tokens_per_sec")]


def test_step_callbacks_count_a_step_lightning_takes_on_a_short_group(tmp_path: Path) -> None:
    # Lightning steps on an epoch's last batch when the group is not full; the export and the throughput log were
    # due only after a batch whose index the group size divides: steps 3 and 6 came after batch 5, and nothing was
    # exported or logged in the whole run.
    logged = run_ranks(_export_and_log_every_3_steps, 1, str(tmp_path))[0]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["final", "step=3", "step=6"]
    assert logged == [2, 5], logged  # Lightning's CSV rows are 0-based: global steps 3 and 6


def test_pruning_never_follows_a_planted_symbolic_link(tmp_path: Path) -> None:
    # A checkpoint's manifest naming `ext/thesis.tex`, `ext` a link planted in the folder: pruning deleted the file
    # the link led to, outside the folder, then crashed on rmdir of the link.
    import os

    from lightning_llmpar.checkpointing.manifest import remove_owned, verify_manifest, write_manifest

    ckpt, outside = tmp_path / "ckpts" / "step=2.ckpt", tmp_path / "home"
    ckpt.mkdir(parents=True)
    outside.mkdir()
    (outside / "thesis.tex").write_text("a user's file\n")
    (ckpt / "__0_0.distcp").write_bytes(b"x" * 10)
    write_manifest(ckpt, "dcp", "lineage")
    os.symlink(outside, ckpt / "ext")
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"]["ext/thesis.tex"] = {"size": 14, "crc32": "00000000"}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    assert "symbolic link" in verify_manifest(ckpt, manifest)  # never an intact checkpoint to resume from
    with pytest.warns(UserWarning, match=r"kept 1 file\(s\) this library did not write: \['ext'\]"):
        assert remove_owned(ckpt) == ["ext"]
    assert (outside / "thesis.tex").read_text() == "a user's file\n" and (ckpt / "ext").is_symlink()
    assert not (ckpt / "__0_0.distcp").exists()  # what the run wrote is gone
    # A checkpoint path that is itself a link (to a folder of ours) is kept, and so is what it leads to.
    (tmp_path / "linked").symlink_to(ckpt.parent)
    assert remove_owned(tmp_path / "linked") == [str(tmp_path / "linked")] and (tmp_path / "linked").is_symlink()


def _loaded_dtype(directory: str) -> str:
    from transformers import AutoModelForCausalLM

    return str(next(AutoModelForCausalLM.from_pretrained(directory, dtype="auto").parameters()).dtype)


def test_an_export_in_another_dtype_says_so_in_its_config(tmp_path: Path) -> None:
    # bf16 weights under a config saying float32 (the fp32 masters'): from_pretrained(dtype="auto") loaded float32.
    out = run_ranks(train, 1, steps=1, hf_export={"dirpath": str(tmp_path / "bf16"), "dtype": "bfloat16"})[0]
    assert out["error"] is None, out.get("traceback")
    out = run_ranks(train, 1, steps=1, hf_export={"dirpath": str(tmp_path / "fp32")})[0]
    assert out["error"] is None, out.get("traceback")
    for name, dtype in (("bf16", "bfloat16"), ("fp32", "float32")):
        folder = tmp_path / name / "final"
        assert json.loads((folder / "config.json").read_text())["dtype"] == dtype
        assert run_ranks(_loaded_dtype, 1, str(folder))[0] == f"torch.{dtype}"
