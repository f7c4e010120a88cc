"""Pretrained Hugging Face weights in and out at any layout, and checkpoints of split fused/tied weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_ranks
from tests.zoo import fit_cases, logits_of, save_pretrained

pytest.importorskip("transformers")

MODELS = ["llama_tied", "phi3_gqa", "mixtral", "gpt2", "gpt_oss", "bamba", "qwen3_5_moe", "kimi_linear", "mpt", "dbrx"]  # tied,
# fused q/k/v + gate/up, legacy MoE files, Conv1D, per-head sinks and experts with biases and interleaved gate/up
# columns, Mamba-2 mixers (five pieces packed in in_proj, init code copying whole per-head values), gated delta-rule
# mixers (packed q/k/v), files in another layout (Kimi Linear: q/k/v convolutions saved apart, renamed gate parts),
# a fused [q; k; v] with ALiBi biases (MPT), experts stacked in 2-D weights (DBRX)
LAYOUTS = {"tp2": ({"tensor_parallel": 2}, 2), "tp2-pp2": ({"tensor_parallel": 2, "pipeline_parallel": 2}, 4)}
STEPS, BATCH = 3, 8


def _save_all(names: list[str], root: str) -> None:
    for name in names:
        save_pretrained(name, f"{root}/{name}")


def _logits(directories: list[str]) -> list[torch.Tensor]:
    return [logits_of(d) for d in directories]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory, selected_params: list[dict[str, Any]]) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf")
    run_ranks(_save_all, 1, MODELS, str(root))  # every family in one launch: the other tests read several
    # Trained only where this run selected a round trip (-m "not full" runs a slice).
    chosen = {(p["model"], p["layout"]) for p in selected_params if "layout" in p}
    trained = [m for m in MODELS if any((m, layout) in chosen for layout in LAYOUTS)]
    ref_cases = [(m, None, BATCH, {"pretrained": str(root / m), "save_hf": str(root / f"{m}-ref"), "steps": STEPS})
                 for m in trained]
    refs = run_ranks(fit_cases, 1, ref_cases, timeout=600)[0] if trained else {}
    runs: dict[str, dict[str, Any]] = {}
    for layout, (kwargs, world) in LAYOUTS.items():
        models = [m for m in MODELS if (m, layout) in chosen]
        cases = [(m, kwargs, BATCH * 2 // world if "pipeline_parallel" not in kwargs else BATCH,
                  {"pretrained": str(root / m), "meta": True, "save_hf": str(root / f"{m}-{layout}"), "steps": STEPS})
                 for m in models]
        outs = run_ranks(fit_cases, world, cases, timeout=900) if models else []
        runs[layout] = {m: [o[(m, repr(kwargs))] for o in outs] for m in models}
    return {"root": root, "refs": {m: refs[(m, "None")] for m in trained}, "runs": runs}


# Every family's files are converted at tp2; tp2 x pp2 adds a split into stages, the same for every family's files
# once the names are converted: tied, fused, Conv1D and the legacy MoE files on four ranks.
CASES = [(m, "tp2") for m in MODELS] + [(m, "tp2-pp2") for m in ("llama_tied", "phi3_gqa", "mixtral", "gpt2")]


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m}-{lid}" for m, lid in CASES])
def test_pretrained_round_trip(model: str, layout: str, pretrained: dict[str, Any]) -> None:
    ref, outs = pretrained["refs"][model], pretrained["runs"][layout][model]
    assert "error" not in ref, ref.get("error")
    for out in outs:
        assert "error" not in out, out["error"]
    # Meta init + hf_checkpoint, each rank reading its slices, starts where from_pretrained in one process does.
    for i, expected in enumerate(ref["losses"]):
        loss = sum(o["losses"][i] for o in outs) / len(outs)
        assert abs(loss - expected) < 1e-5, f"step {i}: {loss} vs {expected}"
    # Exported at the layout, loaded by from_pretrained in one process: the one-process-trained model's logits.
    root = pretrained["root"]
    ours, theirs = run_ranks(_logits, 1, [str(root / f"{model}-{layout}"), str(root / f"{model}-ref")])[0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_legacy_moe_files_are_read_per_expert(pretrained: dict[str, Any]) -> None:
    from safetensors import safe_open

    with safe_open(str(pretrained["root"] / "mixtral" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    # transformers writes Mixtral experts one tensor per expert; the loader sliced them (round trip above).
    assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in keys)
    assert not any("gate_up_proj" in k for k in keys)


def _edit(src: Path, dst: Path, change: Any) -> str:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def _bad(tensors: dict[str, torch.Tensor], kind: str) -> None:
    if kind == "missing":
        del tensors["model.layers.1.mlp.up_proj.weight"]
    elif kind == "shape":
        tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(32, 16)
    else:
        tensors["model.layers.0.extra.weight"] = torch.zeros(2)


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("missing", r"tensor 'model.layers.1.mlp.up_proj.weight' \(parameter 'model.model.layers.1.mlp.up_proj.weight', shape \(64, 32\)\) is missing"),
        ("shape", r"tensor 'model.layers.0.self_attn.o_proj.weight' has shape \(32, 16\) in the checkpoint but \(32, 32\) in the model"),
        ("unexpected", r"tensor 'model.layers.0.extra.weight' in the checkpoint belongs to no parameter of the model"),
    ],
)
def test_bad_checkpoint_is_refused_before_training(kind: str, match: str, pretrained: dict[str, Any], tmp_path: Path) -> None:
    path = _edit(pretrained["root"] / "llama_tied", tmp_path / kind, lambda t: _bad(t, kind))
    outs = run_ranks(fit_cases, 2, [("llama_tied", {"tensor_parallel": 2}, BATCH, {"pretrained": path, "meta": True})])
    for out in outs:
        error = out[("llama_tied", repr({"tensor_parallel": 2}))]["error"]
        assert "ValueError" in error and __import__("re").search(match, error), error
        assert "training_step" not in error  # refused in setup, before any step
        assert kind == "unexpected" or "belongs to no parameter" not in error  # a misshaped tensor is named once


def test_missing_directory_and_other_model_are_refused(pretrained: dict[str, Any], tmp_path: Path) -> None:
    from lightning_llmpar import LLMParallelStrategy

    with pytest.raises(ValueError, match=r"hf_checkpoint='.*nowhere' is not a directory"):
        LLMParallelStrategy(hf_checkpoint=str(tmp_path / "nowhere"))
    outs = run_ranks(fit_cases, 1, [("llama_tied", {}, BATCH, {"pretrained": str(pretrained["root"] / "gpt2")})])
    error = outs[0][("llama_tied", "{}")]["error"]
    assert "ValueError" in error and "config.json has model_type='gpt2' but the model has 'llama'" in error, error


def test_exporting_a_model_that_is_not_transformers_names_the_export_that_fits(tmp_path: Path) -> None:
    # A LitGPT model's export was refused as if it were a load ("hf_checkpoint loads into ..."), naming no way out.
    from types import SimpleNamespace

    from lightning_llmpar import save_hf_checkpoint
    from lightning_llmpar.models import GPTModule

    trainer = SimpleNamespace(strategy=None, lightning_module=GPTModule(vocab_size=64, block_size=16, n_layer=2, n_embd=32))
    with pytest.raises(ValueError, match=r"save_hf_checkpoint exports .* found 0 .* lightning_llmpar.export_consolidated"):
        save_hf_checkpoint(trainer, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_untied_checkpoint_into_a_tied_model_is_refused(pretrained: dict[str, Any], tmp_path: Path) -> None:
    # Both tensors were read into the one tied parameter, the second overwriting the first, without a word.
    def untie(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1

    path = Path(_edit(pretrained["root"] / "llama_tied", tmp_path / "untied", untie))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    outs = run_ranks(fit_cases, 1, [("llama_tied", {}, BATCH, {"pretrained": str(path)})])
    error = outs[0][("llama_tied", "{}")]["error"]
    assert "ValueError" in error and "config.json has tie_word_embeddings=False but the model has True" in error, error


def test_checkpoint_in_a_layout_not_read_per_rank_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A conversion transformers applies while loading that a per-rank read of regions cannot (here Kimi Linear's
    # q/k/v convolutions, joined by a transpose instead of a concatenation): refused with from_pretrained as the fix.
    import transformers.conversion_mapping as mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    from lightning_llmpar.checkpointing.hf_checkpoint import load_hf_checkpoint
    from tests.zoo import HFCausalLM

    declared = mapping.extract_weight_conversions_for_model

    def other_layout(model: Any, *args: Any, **kwargs: Any) -> Any:
        return [WeightConverter(t.source_patterns, t.target_patterns, operations=[Transpose(0, 1)])
                if "conv1d" in str(t.target_patterns) else t for t in declared(model, *args, **kwargs)]

    monkeypatch.setattr(mapping, "extract_weight_conversions_for_model", other_layout)
    save_pretrained("kimi_linear", str(tmp_path / "kimi"))
    with pytest.raises(ValueError, match=r"is missing.*q_conv1d.weight.*-> self_attn.conv1d.weight.*from_pretrained"):
        load_hf_checkpoint(HFCausalLM("kimi_linear"), tmp_path / "kimi")


def test_checkpoints_of_split_fused_and_tied_weights_reshard(tmp_path: Path) -> None:
    # Saved with fused projections split per piece (tp2) and tied weights copied per stage (pp2), resumed in
    # another layout with AdamW (optimizer state too): the run continues exactly like one process's.
    # Lightning decides which batches follow a resume (a plain dataloader restarts its epoch), so the
    # reference is one process saving and resuming with Lightning's own checkpoint file.
    models = ["phi3_gqa", "gpt2"]
    run_ranks(fit_cases, 1, [(m, None, BATCH, {"steps": 3, "save_to": str(tmp_path / f"{m}-plain.ckpt"), "sgd": False}) for m in models])
    whole = run_ranks(fit_cases, 1, [(m, None, BATCH, {"steps": 6, "ckpt_path": str(tmp_path / f"{m}-plain.ckpt"), "sgd": False})
                                     for m in models])[0]
    saves = {"tp2": ({"tensor_parallel": 2}, 2), "pp2": ({"pipeline_parallel": 2}, 2)}
    for tag, (kwargs, world) in saves.items():
        run_ranks(fit_cases, world, [(m, kwargs, BATCH, {"steps": 3, "save_to": str(tmp_path / f"{m}-{tag}.ckpt"), "sgd": False}) for m in models])
    resumes = {"pp2": ("tp2", {"pipeline_parallel": 2}, 2), "one": ("pp2", {}, 1), "tp2": ("pp2", {"tensor_parallel": 2}, 2)}
    for target, (source, kwargs, world) in resumes.items():
        cases = [(m, kwargs, BATCH, {"steps": 6, "ckpt_path": str(tmp_path / f"{m}-{source}.ckpt"), "sgd": False}) for m in models]
        outs = run_ranks(fit_cases, world, cases)
        for m in models:
            results = [o[(m, repr(kwargs))] for o in outs]
            for r in results:
                assert "error" not in r, r["error"]
            for i in range(3):
                loss = sum(r["losses"][i] for r in results) / len(results)
                assert abs(loss - whole[(m, "None")]["losses"][i]) < 1e-5, (m, source, target, i)
