"""Checkpoints written under one layout resume under another and continue exactly like an uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llmpar import export_consolidated
from lightning_llmpar.checkpointing.dcp import is_checkpoint
from tests.distributed import run_ranks
from tests.workloads import fit, fit_error, make_gpt

GLOBAL_BATCH, SAMPLES = 16, 80  # 5 steps per epoch: the checkpoint falls on an epoch boundary


def _fit(world: int, kwargs: dict[str, Any] | None, **fit_kwargs: Any) -> list[dict[str, Any]]:
    tp = (kwargs or {}).get("tensor_parallel", 1)
    return run_ranks(fit, world, "gpt", kwargs, batch_size=GLOBAL_BATCH // (world // tp), samples=SAMPLES, **fit_kwargs)


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, Any]:
    return _fit(1, None, steps=10)[0]


@pytest.fixture(scope="module")
def plain_resume(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Single-device Lightning saving after epoch 0 and resuming from its own checkpoint file.

    Lightning's loops decide which batches follow a resume; matching this run shows our checkpoint
    restores every piece of state Lightning's own does (weights, optimizer, scheduler, loops).
    """
    path = tmp_path_factory.mktemp("plain") / "epoch0.ckpt"
    _fit(1, None, steps=-1, epochs=1, save_to=str(path))
    return _fit(1, None, steps=10, ckpt_path=str(path))[0]


@pytest.fixture(scope="module")
def saved_tp2_dp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    path = tmp_path_factory.mktemp("ckpt") / "epoch0.ckpt"
    outs = _fit(4, {"tensor_parallel": 2, "zero_stage": 3}, steps=-1, epochs=1, save_to=str(path))
    return path, outs


def test_checkpoint_is_complete_and_atomic(saved_tp2_dp2: tuple[Path, list[dict[str, Any]]]) -> None:
    path, _ = saved_tp2_dp2
    assert is_checkpoint(path)
    assert not any(p.name.endswith(".partial") for p in path.parent.iterdir())


@pytest.mark.parametrize(
    ("world", "kwargs"),
    [
        pytest.param(2, {"zero_stage": 1}, id="to-dp2"),
        pytest.param(1, {}, id="to-one-process"),
        pytest.param(2, {"tensor_parallel": 2}, id="to-tp2"),
    ],
)
def test_resume_in_another_layout_continues_exactly(
    saved_tp2_dp2: tuple[Path, list[dict[str, Any]]],
    uninterrupted: dict[str, Any],
    plain_resume: dict[str, Any],
    world: int,
    kwargs: dict[str, Any],
) -> None:
    path, first_half = saved_tp2_dp2
    outs = _fit(world, kwargs, steps=10, ckpt_path=str(path))
    for i in range(5):
        before = sum(o["losses"][i] for o in first_half) / len(first_half)
        assert abs(before - uninterrupted["losses"][i]) < 1e-5
    assert all(len(o["losses"]) == 5 for o in outs), "resume must continue at step 5, not restart"
    # The first step after resume uses only the restored weights: it equals the uninterrupted run.
    first = sum(o["losses"][0] for o in outs) / len(outs)
    assert abs(first - uninterrupted["losses"][5]) < 1e-5
    for i in range(5):
        after = sum(o["losses"][i] for o in outs) / len(outs)
        assert abs(after - plain_resume["losses"][i]) < 1e-5, f"step {5 + i}: {after} vs {plain_resume['losses'][i]}"
    for name, param in plain_resume["params"].items():
        torch.testing.assert_close(outs[0]["params"][name], param, atol=5e-4, rtol=0)


def test_a_checkpoint_of_another_model_is_refused_naming_its_entries(
    saved_tp2_dp2: tuple[Path, list[dict[str, Any]]]
) -> None:
    # DCP loads what the model asks for: the 4-layer checkpoint's layers 2-3 were dropped without a word into a
    # 2-layer model, and a resized vocabulary failed inside DCP's collective with a CheckpointException (not an
    # Exception) naming one key. Both are a ValueError on every rank, before anything is read.
    path, _ = saved_tp2_dp2
    fewer = run_ranks(fit_error, 2, "gpt_two_layers", {"pipeline_parallel": 2, "pipeline_schedule": "1F1B"}, batch_size=16, steps=6, ckpt_path=str(path))
    assert len(set(fewer)) == 1, fewer
    assert "ValueError: Checkpoint" in fewer[0] and "model: 18 entries not in the model (model.layers.2." in fewer[0], fewer[0]
    assert "strict_loading = False" in fewer[0]
    vocab = run_ranks(fit_error, 2, "gpt_vocab_48", {"tensor_parallel": 2}, batch_size=16, steps=6, ckpt_path=str(path))
    assert len(set(vocab)) == 1, vocab
    assert "model: 2 entries of another shape (model.lm_head.weight (saved (64, 32), model (48, 32)), model.tok_emb" in vocab[0], vocab[0]


def test_export_consolidated_loads_into_a_plain_module(
    saved_tp2_dp2: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    path, outs = saved_tp2_dp2
    out_file = export_consolidated(path, tmp_path / "model.pt")
    state = torch.load(out_file, weights_only=True)
    module = make_gpt()
    module.load_state_dict(state, strict=True)
    for name, param in module.named_parameters():
        torch.testing.assert_close(param.detach(), outs[0]["params"][name], atol=0, rtol=0)


def _save_from_a_folder_of_each_rank(root: str) -> str | None:
    """Each rank in a folder of its own and a relative checkpoint path: what one path on each node's own disk is."""
    import os

    rank = int(os.environ["RANK"])
    folder = Path(root) / f"node{rank}"
    folder.mkdir()
    os.chdir(folder)
    return fit_error("gpt", {"zero_stage": 3}, batch_size=8, steps=1, save_to="a.ckpt")


def test_a_checkpoint_folder_some_rank_cannot_see_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    # Rank 0 committed its own shards and checksummed them as the whole checkpoint; rank 1's stayed in a staging
    # folder on its own "disk"; only a resume found it out (a periodic ModelCheckpoint wrote unusable checkpoints
    # all run long).
    errors = run_ranks(_save_from_a_folder_of_each_rank, 2, str(tmp_path))
    assert all(e is not None and "Save to a folder every node shares" in e for e in errors), errors
    assert [sorted(p.name for p in (tmp_path / f"node{r}").iterdir()) for r in (0, 1)] == [[], []]
