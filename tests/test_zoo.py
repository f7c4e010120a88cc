"""Third-party architectures (Hugging Face families, LitGPT families), tied and untied, under TP, PP, ZeRO and a
4-rank combination: exact vs one process.

All cases of one world size run inside one launch of the ranks; each model's one-process reference runs once.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from tests.distributed import run_ranks
from tests.zoo import assert_exact, fit_cases

pytest.importorskip("transformers")

MODELS = [
    "llama", "llama_tied", "qwen2", "qwen2_tied", "qwen3", "mistral", "gemma2", "phi3", "phi3_gqa", "gpt2",
    "gpt2_untied", "gpt_neox", "opt", "mixtral", "olmo2", "starcoder2", "falcon", "bloom", "granite", "qwen3_moe",
]
# Newer families at the two layouts that depend on a model's structure (ZeRO shards every block alike): MoE layers
# with a shared expert and its gate, parallel attention and MLP, per-head fused q/k/v with per-head norms, layers
# without rotary positions, squared-ReLU MLPs, an activation with parameters (Apertus' xIELU), (E, in, out) experts
# in a MoE layer that returns flat tokens and reads the embedding's weight (Llama 4), latent attention split by
# heads (DeepSeek-V3; DeepSeek-V2 without a query latent), per-head attention sinks and experts with biases and
# interleaved gate/up columns (GPT-OSS), state-space models (Mamba, and hybrids whose block stack mixes classes, blocks
# return tuples or the forward reads block attributes), gated delta-rule linear attention (Qwen3-Next, Qwen3.5,
# OLMo-Hybrid), gated short convolutions (LFM2), lightning attention (MiniMax) and Kimi delta attention; fused
# [q; k; v] rows with ALiBi biases (MPT), blocks that return lists (OpenAI GPT), per-head fused q/k/v (GPTBigCode),
# attention output gates per feature (AFMoE) and per head (LFM3); experts called by the block itself and per-layer
# head counts (Gemma 4), an MLP in an nn.Sequential kept whole and an embedding scaled in place (CTRL); q/k/v fused in
# groups by a constant of the forward (CodeGen), differential attention's paired heads and shared λ (DiffLlama), and a
# dynamic mask computed from all key/value heads with a parameter per key/value head (Doge), and an attention that
# returns a bias of its own for the block to add (GPT-NeoX-Japanese); experts stored as 2-D weights stacking every
# expert's FFN rows (DBRX).
MORE_MODELS = ["qwen2_moe", "glm4_moe", "gemma3", "cohere", "phi", "smollm3", "persimmon", "nemotron", "apertus", "llama4",
               "deepseek_v3", "deepseek_v2", "gpt_oss", "mamba", "jamba", "bamba", "nemotron_h", "falcon_h1",
               "granitemoehybrid", "qwen3_next", "qwen3_5_moe", "olmo_hybrid", "lfm2", "minimax", "kimi_linear", "mpt",
               "openai_gpt", "gpt_bigcode", "afmoe", "lfm3", "gemma4", "ctrl", "codegen", "diffllama", "doge",
               "gpt_neox_japanese", "dbrx"]
# Per-layer inputs computed before the stack (Gemma 4's small models, Gemma 3n): exact at tp2; under pipeline
# parallelism with one stage per rank, see test_blocks_reading_values_from_before_the_stack_under_pipeline_parallelism.
TP_ONLY = ["gemma4_ple", "gemma3n"]
# Blocks tied to one shared attention block (Zamba2): ZeRO-3 shards it as a unit of its own. Tensor parallelism does
# not split its Mamba layers; its blocks read the embeddings (pipeline parallelism: the test named above).
DP_ONLY = ["zamba2"]
# Fewer key/value heads than ranks, each shared by several (multi-query attention: Gemma-2B's layout, Qwen3's per-head
# k norm, OLMo-2's k norm over its one head, StarCoder's and Falcon-7B's fused [all q; k; v], Falcon's grouped rows
# with one group, RecurrentGemma); grouped-query attention at tp4 above its two key/value heads (Qwen2).
KV_SHARED = ["gemma_mqa", "qwen3_mqa", "olmo2_mqa", "gpt_bigcode_mqa", "falcon_mqa", "falcon_kv1", "recurrent_gemma"]
# A Llama written as torchtitan writes its models: blocks in an nn.ModuleDict walked by values(), the rotary table
# handed to every block (tests/titan_models.py); every schedule and context parallelism in its own test below.
TITAN = ["titan_tied", "titan_untied"]
LITGPT_MODELS = ["litgpt_llama", "litgpt_pythia", "litgpt_gemma2", "litgpt_phi2", "litgpt_qwen3", "litgpt_mixtral",
                 "litgpt_falcon", "litgpt_gemma3", "litgpt_olmo2"]
HAS_LITGPT = importlib.util.find_spec("litgpt") is not None
ALL = MODELS + MORE_MODELS + TP_ONLY + KV_SHARED + LITGPT_MODELS + TITAN  # the layouts not in ONLY
RUN = MODELS + MORE_MODELS + TP_ONLY + DP_ONLY + KV_SHARED + ["qwen2_gqa"] + (LITGPT_MODELS if HAS_LITGPT else []) + TITAN
GLOBAL_BATCH = 8
TWO_RANKS = {
    "tp2": {"tensor_parallel": 2},
    "pp2": {"pipeline_parallel": 2},
    "dp2-zero3": {"zero_stage": 3},
    "dp2-zero1": {"zero_stage": 1},
}
# ZeRO-1 is the same for every model family (no structure involved): LitGPT's cover it. ZeRO-3 shards every block
# alike, so it runs on each kind of weight it handles differently: tied (embedding and head one parameter), fused
# rows, experts (3-D and module lists), Conv1D, ALiBi, ModuleDict stacks, LitGPT, and Zamba2's shared block.
# tp2 x pp2 composes each family's tensor-parallel plan (every family at tp2) with its split (every family at pp2):
# it runs where the two meet differently (a tied embedding and head on two stages, Conv1D and a vocabulary the
# degree does not divide, experts split on a stage, one key/value head, a ModuleDict stack, LitGPT's rotary tables).
SHARDED = ["llama_tied", "qwen2_tied", "gpt2", "phi3", "gpt_neox", "mixtral", "qwen3_moe", "bloom", "falcon", "zamba2",
           "titan_tied", "litgpt_llama", "litgpt_mixtral", "litgpt_gemma2"]
COMPOSED = ["llama_tied", "gpt2", "mixtral", "falcon_mqa", "titan_tied", "litgpt_falcon"]
ONLY = {"dp2-zero1": LITGPT_MODELS, "dp2-zero3": SHARDED,
        "tp2-pp2": COMPOSED, "pp2": MODELS + MORE_MODELS + LITGPT_MODELS + TITAN,
        "tp4": ["qwen2_gqa", "gemma_mqa"], "dp2-tp2-zero3": ["gemma_mqa", "gpt_bigcode_mqa"]}
FOUR_RANKS = {"tp2-pp2": {"tensor_parallel": 2, "pipeline_parallel": 2}, "tp4": {"tensor_parallel": 4},
              "dp2-tp2-zero3": {"tensor_parallel": 2, "zero_stage": 3}}


def _batch(kwargs: dict[str, Any], world: int) -> int:
    return GLOBAL_BATCH * kwargs.get("tensor_parallel", 1) * kwargs.get("pipeline_parallel", 1) // world


def _models(layout: str) -> list[str]:
    return [m for m in ONLY.get(layout, ALL) if m in RUN]


def _launch(layouts: dict[str, dict[str, Any]], world: int, selected: list[dict[str, Any]]
            ) -> dict[tuple[str, str], list[dict[str, Any]]]:
    # Only the cases this run selected (-m "not full" runs a slice of the zoo).
    chosen = {(p["model"], p["layout"]) for p in selected if "layout" in p}
    pairs = [(m, lid) for lid in layouts for m in _models(lid) if (m, lid) in chosen]
    if not pairs:
        return {}
    cases = [(m, layouts[lid], _batch(layouts[lid], world)) for m, lid in pairs]
    outs = run_ranks(fit_cases, world, cases, timeout=2400)
    return {(m, lid): [o[(m, repr(layouts[lid]))] for o in outs] for m, lid in pairs}


class _References(dict):
    """One-process runs by model: the parametrized tests' in one launch, any other model on first use."""

    def __missing__(self, model: str) -> dict[str, Any]:
        self[model] = run_ranks(fit_cases, 1, [(model, None, GLOBAL_BATCH)], timeout=900)[0][(model, "None")]
        return self[model]


@pytest.fixture(scope="module")
def references(selected_params: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    wanted = [m for m in RUN if m in {p.get("model") for p in selected_params}]
    outs = run_ranks(fit_cases, 1, [(m, None, GLOBAL_BATCH) for m in wanted], timeout=900)[0] if wanted else {}
    return _References({m: outs[(m, "None")] for m in wanted})


def _cases(layouts: dict[str, dict[str, Any]]) -> list[Any]:
    litgpt = pytest.mark.skipif(not HAS_LITGPT, reason="litgpt is not installed (pip install --no-deps litgpt)")
    return [pytest.param(m, lid, id=f"{m}-{lid}", marks=[litgpt] if m in LITGPT_MODELS else [])
            for lid in layouts for m in ONLY.get(lid, ALL)]


@pytest.fixture(scope="module")
def two_rank_runs(selected_params: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    return _launch(TWO_RANKS, 2, selected_params)


@pytest.fixture(scope="module")
def four_rank_runs(selected_params: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    return _launch(FOUR_RANKS, 4, selected_params)


@pytest.mark.parametrize(("model", "layout"), _cases(TWO_RANKS))
def test_two_ranks_match_one_process(model: str, layout: str, references: dict, two_rank_runs: dict) -> None:
    assert_exact(references[model], two_rank_runs[(model, layout)], sharded=layout != "dp2-zero1")


@pytest.mark.parametrize(("model", "layout"), _cases(FOUR_RANKS))
def test_four_ranks_match_one_process(model: str, layout: str, references: dict, four_rank_runs: dict) -> None:
    assert_exact(references[model], four_rank_runs[(model, layout)])


def test_blocks_reading_values_from_before_the_stack_under_pipeline_parallelism(references: dict) -> None:
    # Gemma 3n's per-layer inputs (through a scale initialized to zero, so at initialization only a later stage's
    # gradients show that it reads them: it trained silently wrong before) and Zamba2's embeddings are computed
    # before the stack: those modules run on every rank, their gradients summed, the embedding tied to the head.
    one_stage = {"pipeline_parallel": 2, "pipeline_schedule": "1F1B"}
    two = [("gemma3n", one_stage, GLOBAL_BATCH), ("zamba2", {**one_stage, "pipeline_schedule": "GPipe"}, GLOBAL_BATCH),
           ("gemma3n", {"pipeline_parallel": 2}, GLOBAL_BATCH), ("gemma4_ple", one_stage, GLOBAL_BATCH)]
    four = [("gemma3n", {**one_stage, "pipeline_parallel": 4}, GLOBAL_BATCH),
            ("zamba2", {**one_stage, "zero_stage": 3}, GLOBAL_BATCH // 2),
            ("zamba2", {**one_stage, "tensor_parallel": 2}, GLOBAL_BATCH)]
    outs2, outs4 = run_ranks(fit_cases, 2, two, timeout=900), run_ranks(fit_cases, 4, four, timeout=900)
    for (name, kwargs, _), outs in [*zip(two[:2], [outs2] * 2), *zip(four[:2], [outs4] * 2)]:
        assert_exact(references[name], [o[(name, repr(kwargs))] for o in outs], sharded=False)
    # Tensor parallelism takes the stack the pipeline split, not the largest list left on a rank's part (Zamba2's
    # adapter lists, which it once split alone: the model trained replicated, 75% of it on every rank).
    errors = [o[("zamba2", repr(four[2][1]))].get("error", "") for o in outs4]
    assert all("Cannot decide how to split Linear" in e and "gate_up_proj_adapter_list" in e for e in errors), errors
    # Several stages per rank (the default interleaved schedule) cannot share them: refused with the fix.
    errors = [o[("gemma3n", repr(two[2][1]))].get("error", "") for o in outs2]
    assert all("run on every pipeline rank" in e and "pipeline_schedule='1F1B'" in e for e in errors), errors
    # Gemma 4's small models also reuse earlier layers' keys and values in their last layers: no cut of four layers
    # keeps them on one stage, and the split says so.
    errors = [o[("gemma4_ple", repr(one_stage))].get("error", "") for o in outs2]
    assert all("Pipeline split: stage 1" in e and "fails when run on its own" in e for e in errors), errors


SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def test_tied_weights_stay_tied_under_every_schedule_and_zero(references: dict) -> None:
    # Stage copies of a tied embedding/head: on two ranks (interleaved) or on one rank (V-shaped schedules),
    # alone and with the stages sharded by ZeRO.
    two = [("llama_tied", {"pipeline_parallel": 2, "pipeline_schedule": s}, GLOBAL_BATCH) for s in SCHEDULES]
    four = [("llama_tied", {"pipeline_parallel": 2, "zero_stage": 3}, GLOBAL_BATCH // 2),
            ("llama_tied", {"pipeline_parallel": 2, "zero_stage": 2, "pipeline_schedule": "ZBVZeroBubble"}, GLOBAL_BATCH // 2)]
    for cases, world in ((two, 2), (four, 4)):
        outs = run_ranks(fit_cases, world, cases, timeout=900)
        for name, kwargs, _ in cases:
            assert_exact(references[name], [o[(name, repr(kwargs))] for o in outs])


@pytest.mark.skipif(not HAS_LITGPT, reason="litgpt is not installed (pip install --no-deps litgpt)")
def test_litgpt_under_every_schedule(references: dict) -> None:
    # LitGPT passes rotary tables and the mask from its forward to every block: each stage must get them.
    cases = [("litgpt_llama", {"pipeline_parallel": 2, "pipeline_schedule": s}, GLOBAL_BATCH) for s in SCHEDULES]
    outs = run_ranks(fit_cases, 2, cases, timeout=900)
    for name, kwargs, _ in cases:
        assert_exact(references[name], [o[(name, repr(kwargs))] for o in outs])


def test_module_dict_keys_other_than_positions_under_sequence_parallelism() -> None:
    # Keys "blk_a".."blk_d" or "1".."4": the sequence was split at block "0" and gathered after block str(N-1), which
    # named no block (a doubled sequence in attention, silently wrong where the rotary table followed it) or the third.
    names = ["titan_named", "titan_from1"]
    refs = run_ranks(fit_cases, 1, [(m, None, GLOBAL_BATCH) for m in names], timeout=900)[0]
    cases = [(m, {"tensor_parallel": 2}, GLOBAL_BATCH) for m in names]
    outs = run_ranks(fit_cases, 2, cases, timeout=900)
    for name, kwargs, _ in cases:
        ref, runs = refs[(name, "None")], [o[(name, repr(kwargs))] for o in outs]
        assert_exact(ref, runs)
        for run in runs:  # what the user reads: the logged loss and its companion value, every step
            for got, want in zip(run["metrics"], ref["metrics"], strict=True):
                for key in ("train_loss", "train_z"):
                    assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (name, key, got, want)


def test_module_dict_stack_under_every_schedule_context_parallelism_and_across_layouts(tmp_path: Any) -> None:
    # torchtitan's layout: blocks in an nn.ModuleDict walked by values(), the rotary table passed to every block. Each
    # pipeline stage keeps its blocks under their keys; ring attention cuts the sequence (per-rank batch 8: the cp
    # ranks read the same batches); ZeRO-3 and activation checkpointing wrap each block. A checkpoint written at pp2
    # loads at tp2 and in one process: the same names.
    refs = run_ranks(fit_cases, 1, [(m, None, GLOBAL_BATCH) for m in TITAN], timeout=900)[0]
    tied = [("titan_tied", {"pipeline_parallel": 2, "pipeline_schedule": s}, GLOBAL_BATCH) for s in SCHEDULES]
    ring = [(m, {"context_parallel": 2}, GLOBAL_BATCH) for m in TITAN]
    # FSDP2 units and activation checkpointing per block of the ModuleDict.
    ring.append(("titan_tied", {"zero_stage": 3}, GLOBAL_BATCH // 2, {"checkpointing": "full", "tag": "zero3-ac"}))
    saved = str(tmp_path / "pp2.ckpt")
    save = [("titan_untied", {"pipeline_parallel": 2}, GLOBAL_BATCH, {"steps": 3, "save_to": saved, "tag": "save"})]
    outs = run_ranks(fit_cases, 2, tied + ring + save, timeout=1800)
    for name, kwargs, _, *extra in tied + ring:
        key = (name, extra[0]["tag"] if extra else repr(kwargs))
        assert_exact(refs[(name, "None")], [o[key] for o in outs], sharded="context_parallel" not in kwargs)
    written = {k: v for o in outs for k, v in o[("titan_untied", "save")]["params"].items()}
    load = [("titan_untied", {"tensor_parallel": 2}, GLOBAL_BATCH, {"steps": 3, "ckpt_path": saved, "tag": "load"})]
    for world, layout in ((2, "tp2"), (1, "one process")):
        cases = load if world == 2 else [("titan_untied", {}, GLOBAL_BATCH, {"steps": 3, "ckpt_path": saved, "tag": "load"})]
        for out in run_ranks(fit_cases, world, cases, timeout=900):
            loaded = out[("titan_untied", "load")]
            assert "error" not in loaded, loaded["error"]
            assert sorted(loaded["params"]) == sorted(written), layout
            for key, value in written.items():
                torch.testing.assert_close(loaded["params"][key], value, atol=0, rtol=0, msg=f"{layout}: {key}")
