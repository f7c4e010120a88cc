"""Hugging Face loads read only inside the model folder, and a bad shard is refused on every rank alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.checkpointing.scenarios import save_pretrained_llama, train
from tests.distributed import run_ranks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "model"
    run_ranks(save_pretrained_llama, 1, str(folder), shards=True)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_index_naming_a_file_outside_the_folder_is_refused(sharded: Path, tmp_path: Path, where: str) -> None:
    folder = tmp_path / "model"
    shutil.copytree(sharded, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    key, shard = next(iter(index["weight_map"].items()))
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(folder / shard, outside / "stolen.safetensors")
    named = str(outside / "stolen.safetensors") if where == "absolute" else "../outside/stolen.safetensors"
    index["weight_map"][key] = named
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    out = run_ranks(train, 1, steps=1, hf_checkpoint=str(folder))[0]
    assert out["error"] and "a file outside" in out["error"] and named in out["error"], out["error"]
    assert out["steps"] == []


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_bad_shard_seen_by_one_rank_is_refused_on_every_rank(sharded: Path, tmp_path: Path, damage: str) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(sharded, bad)
    shard = max(bad.glob("model-*.safetensors"))
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-64])
    else:
        shard.unlink()
    # Rank 0 reads an intact copy, rank 1 the damaged one: only rank 1 can see the problem.
    outs = run_ranks(train, 2, steps=1, hf_checkpoint={0: str(sharded), 1: str(bad)}, timeout=240)
    errors = [o["error"] for o in outs]
    assert all(e and e.startswith("ValueError") and shard.name in e for e in errors), errors
    # The same problems on both ranks (each names its own folder first).
    assert errors[0].split("does not fit")[1] == errors[1].split("does not fit")[1], errors
