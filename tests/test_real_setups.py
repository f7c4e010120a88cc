"""Set-ups real fine-tuning runs use: frozen parameters, LoRA, Lightning's precision strings, DeepSpeed with our
precision plugins, dropout, padding, dict outputs, short last batches. Each gives one process's result or is
refused before any work."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn

from lightning_llmpar import LLMParallelStrategy
from tests.distributed import run_ranks
from tests.zoo import assert_exact, fit_cases, logits_of

pytest.importorskip("transformers")

BATCH = 8


def _cases(world: int, cases: list[tuple[str, dict[str, Any] | None, dict[str, Any]]], timeout: float = 600) -> list[dict]:
    """Run (model, strategy kwargs, options) cases, the global batch split over the data-parallel ranks."""
    def per_rank(kwargs: dict[str, Any] | None) -> int:
        if kwargs is None:
            return BATCH
        model_parallel = (kwargs.get(k, 1) for k in ("tensor_parallel", "pipeline_parallel", "context_parallel"))
        return BATCH * math.prod(model_parallel) // world

    specs = [(m, kw, opt.get("batch", per_rank(kw)), {**{k: v for k, v in opt.items() if k != "batch"}, "tag": str(i)})
             for i, (m, kw, opt) in enumerate(cases)]
    outs = run_ranks(fit_cases, world, specs, timeout=timeout)
    return [[o[(m, str(i))] for o in outs] for i, (m, _, _) in enumerate(cases)]


# ----------------------------------------------------------------------------------------- frozen parameters


FROZEN = [{"frozen": "head_only", "clip": 1.0}, {"frozen": "lora", "clip": 1.0}, {"frozen": "attention", "clip": 1.0}]


def test_frozen_parameters_and_lora_match_one_process_with_clipping() -> None:
    pytest.importorskip("peft")
    refs = _cases(1, [("llama", None, o) for o in FROZEN])
    head, lora, attention = FROZEN
    # A pipeline stage with nothing to train still joins the clipping collective (it used to hang here).
    # ZeRO-2 groups the (partly or wholly frozen) blocks into shared FSDP2 units; ZeRO-3 keeps one unit per block.
    # Tensor parallelism (LoRA under it: below): frozen attention projections still reduce their
    # region's input gradient once, and the sequence-parallel norms' partial gradients are completed before clipping.
    cases = [({"pipeline_parallel": 2}, head, 0), ({"pipeline_parallel": 2}, lora, 1), ({"zero_stage": 3}, lora, 1),
             ({"zero_stage": 2}, head, 0), ({"zero_stage": 2}, lora, 1), ({"tensor_parallel": 2}, head, 0),
             ({"tensor_parallel": 2}, attention, 2), ({"tensor_parallel": 2, "sequence_parallel": False}, attention, 2)]
    two = _cases(2, [("llama", kw, o) for kw, o, _ in cases], timeout=300)
    for (_, _, ref), outs in zip(cases, two, strict=True):
        assert_exact(refs[ref][0], outs)
    assert set(refs[1][0]["grads"]) == {n for n in refs[1][0]["grads"] if "lora_" in n}, "only adapters train"


def test_fused_adamw_on_tied_frozen_and_padded_models_matches_one_process() -> None:
    # Each layout steps AdamW with torch's fused kernel (fused_optimizer=True) and, in the same launch, with
    # torch's loop; one process runs the loop. Tensor parallelism alone leaves plain tensors among DTensors in the
    # one group, which runs the fused kernel once per kind. Models: a tied GPT-2 (embedding and head one parameter), frozen
    # parameters and LoRA adapters (no gradient, no update), a padded dict batch averaged over valid tokens.
    pytest.importorskip("peft")
    adam = {"sgd": False, "clip": 1.0}
    cases = [("gpt2", adam), ("llama", {**adam, "frozen": "head_only"}), ("llama", {**adam, "frozen": "lora"}),
             ("qwen3", {**adam, "padded": True})]
    layouts = {"gpt2": [{"tensor_parallel": 2}, {"zero_stage": 3}], "llama": [{"zero_stage": 2}, {"pipeline_parallel": 2}],
               "qwen3": [{"zero_stage": 3, "loss_normalization": "tokens"}]}
    refs = _cases(1, [(m, None, o) for m, o in cases])
    runs = [(ref[0], m, kw, o) for ref, (m, o) in zip(refs, cases) for kw in layouts[m]]
    outs = _cases(2, [(m, {**kw, "fused_optimizer": fused}, o) for _, m, kw, o in runs for fused in (True, False)])
    for (ref, m, kw, _), fused, loop in zip(runs, outs[::2], outs[1::2], strict=True):
        if "loss_normalization" not in kw:  # with it, each rank logs the mean of its own tokens
            assert_exact(ref, fused, sharded=False)
        assert ref["kernels"] == {"torch's choice"}, m
        expected = {"fused per tensor kind"} if "tensor_parallel" in kw else {"fused"}
        assert set().union(*(o["kernels"] for o in fused)) == expected, (m, kw)
        weights = [{n: p for o in run for n, p in o["params"].items()} for run in (fused, loop)]
        # After 6 AdamW steps fp32 rounding grows to ~3e-5 in either kernel (the loop's own distance to one process
        # here); the fused kernel is no further off than that, and the layout within Adam's tolerance
        # (tests/test_parity.py) of one process.
        for name, p in ref["params"].items():
            torch.testing.assert_close(weights[0][name], weights[1][name], atol=5e-5, rtol=0, msg=f"{m} {kw} {name}")
            torch.testing.assert_close(weights[0][name], p, atol=5e-4, rtol=0, msg=f"{m} {kw} {name}")


def test_lora_under_tensor_parallelism_matches_one_process() -> None:
    # Adapters on every Linear of the blocks (lora_B drawn nonzero, so lora_A's gradient shows from the first step):
    # on column splits (q/k/v, gate/up; GPT-2's fused Conv1D c_attn and Phi-3's fused qkv and gate_up split per
    # piece, lora_B with them) and row splits (o/down; Doge's dt_proj, whose output is cut to this rank's key/value
    # heads), with and without sequence parallelism; on key/value heads shared by both ranks (Gemma-2B's one
    # key/value head, Falcon-7B's and StarCoder's fused [all q; k; v]), lora_B gathered per head as its base layer.
    # With adapter dropout, masks on a column split's or shared heads' replicated input are alike on every rank, so
    # the replicated lora_A stay equal.
    pytest.importorskip("peft")
    lora = {"frozen": "lora_all"}
    models = ["llama", "gpt2", "phi3", "doge", "gemma_mqa", "falcon_mqa", "gpt_bigcode_mqa"]
    clip = {**lora, "clip": 0.5}
    *one, clip_ref = _cases(1, [(m, None, lora) for m in models] + [("gemma_mqa", None, clip)])
    refs = dict(zip(models, one, strict=True))
    tp, no_sp = {"tensor_parallel": 2}, {"tensor_parallel": 2, "sequence_parallel": False}
    exact = [(m, tp, lora) for m in models] + [("llama", no_sp, lora), ("gemma_mqa", no_sp, lora)]
    dropout = [(m, tp, {**lora, "dropout": 0.1}) for m in ("llama", "gemma_mqa", "falcon_mqa")]
    others = [("llama", tp, {"frozen": "dora"}), ("jamba", tp, lora), ("qwen3_moe", tp, lora)]
    outs = _cases(2, exact + dropout + others, timeout=300)
    for (m, _, _), run in zip(exact, outs, strict=False):
        assert_exact(refs[m][0], run)
    assert set(refs["llama"][0]["grads"]) == {n for n in refs["llama"][0]["grads"] if "lora_" in n}, "only adapters train"
    for (m, _, _), dropped in zip(dropout, outs[len(exact):], strict=False):
        assert "error" not in dropped[0], dropped[0].get("error")
        for name, p in dropped[0]["params"].items():
            assert torch.equal(p, dropped[1]["params"][name]), (m, name)
    dora, mamba, experts = outs[len(exact) + len(dropout):]
    assert "adapter variant" in dora[0]["error"] and "use_dora=False" in dora[0]["error"]
    # Refused before work: adapters on a Mamba mixer's projections, and on fused MoE experts (peft's "all-linear").
    assert "a state-space or linear-attention mixer" in mamba[0]["error"]
    assert "mlp.experts' is a LoRA adapter" in experts[0]["error"] and "MoE experts" in experts[0]["error"]
    # Composed on four ranks: with ZeRO-3 sharding the adapters and clipping, and with a pipeline.
    tp_pp = {"tensor_parallel": 2, "pipeline_parallel": 2}
    four = _cases(4, [("gemma_mqa", {"tensor_parallel": 2, "zero_stage": 3}, clip), ("falcon_mqa", tp_pp, lora),
                      ("llama", tp_pp, lora)], timeout=300)
    for ref, run in zip([clip_ref, refs["falcon_mqa"], refs["llama"]], four, strict=True):
        assert_exact(ref[0], run)


def test_lora_export_folds_the_adapters_as_peft_merges_them(tmp_path: Path) -> None:
    # Exported under peft's names (q_proj.base_layer.weight, lora_A...), from_pretrained initialized every adapted
    # projection at random: logits 0.5 off. The export now holds W + scaling * B @ A, as merge_and_unload.
    pytest.importorskip("peft")
    lora = {"frozen": "lora_all", "steps": 2}
    ref = _cases(1, [("llama", None, {**lora, "save_hf": str(tmp_path / "merged")})])[0][0]
    assert "error" not in ref, ref.get("error")
    layouts = [{"tensor_parallel": 2}, {"pipeline_parallel": 2}]
    for i, outs in enumerate(_cases(2, [("llama", kw, {**lora, "save_hf": str(tmp_path / str(i))}) for i, kw in enumerate(layouts)])):
        assert "error" not in outs[0], outs[0].get("error")
        torch.testing.assert_close(logits_of(str(tmp_path / str(i))), logits_of(str(tmp_path / "merged")), atol=1e-5, rtol=0)
    # Loading per rank into a model peft has wrapped: refused with the fix (it listed every adapter as missing).
    refused = _cases(2, [("llama", layouts[0], {**lora, "pretrained": str(tmp_path / "merged")})])[0][0]
    assert "holds peft adapters" in refused.get("error", "") and "from_pretrained" in refused["error"], refused.get("error")


# ----------------------------------------------------------------------------------------- precision


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize(
    ("precision", "plugin", "tol"),
    [("bf16-mixed", "BF16Precision", 5e-2), ("lightning-16-mixed", "FP16Precision", 5e-3), ("bf16-true", "BF16Precision", 2e-1)],
)
def test_lightning_precision_strings_become_mesh_aware(precision: str, plugin: str, tol: float) -> None:
    # Gradients with SGD against fp32: a loss scale left in the gradients (16-mixed under a pipeline, where the
    # schedule runs backward itself) would be off by a factor of 65536, not by rounding.
    ref = _cases(1, [("llama", None, {"steps": 2})])[0][0]
    runs = _cases(2, [("llama", kw, {"steps": 2, "precision": precision})
                      for kw in ({"tensor_parallel": 2}, {"pipeline_parallel": 2})])
    for outs in runs:
        assert all("error" not in o for o in outs), outs[0].get("error")
        assert {o["plugin"] for o in outs} == {plugin}
        grads = {}
        for o in outs:
            grads.update(o["grads"])
        worst = max(_relative(grads[n], g) for n, g in ref["grads"].items())
        assert 0 < worst < tol, worst


def test_precision_without_an_exact_equivalent_is_refused() -> None:
    with pytest.raises(ValueError, match=r"HalfPrecision\('16-true'\).*use precision='16-mixed'"):
        Trainer(accelerator="cpu", devices=1, strategy=LLMParallelStrategy(), precision="16-true", logger=False)


def test_deepspeed_runs_precision_plugins_in_the_engine() -> None:
    from lightning_llmpar import BF16Precision, FP8Precision, FP16Precision

    ds = {"sharding_backend": "deepspeed", "zero_stage": 2}
    ref = _cases(1, [("llama", None, {"steps": 3})])[0][0]
    runs = _cases(2, [("llama", ds, {"steps": 3, "precision": ("BF16Precision", {"mode": mode})}) for mode in ("true", "mixed")])
    for outs, dtype in zip(runs, ("torch.bfloat16", "torch.float32")):
        assert all("error" not in o for o in outs), outs[0].get("error")
        assert {o["param_dtype"] for o in outs} == {dtype}  # bf16 true: the engine really holds bf16 weights
        losses = [sum(o["losses"][i] for o in outs) / 2 for i in range(3)]
        assert all(0 < abs(a - b) / b < 3e-2 for a, b in zip(losses, ref["losses"])), (losses, ref["losses"])
    # The engine's fp16 needs an fp16-capable device; FP8 has no DeepSpeed equivalent.
    for plugin, match in ((FP16Precision(), r"DeepSpeed's fp16 mode, which cpu does not support"), (FP8Precision(), r"no DeepSpeed equivalent")):
        if isinstance(plugin, FP16Precision) and __import__("deepspeed").accelerator.get_accelerator().is_fp16_supported():
            continue
        with pytest.raises(ValueError, match=match):
            Trainer(accelerator="cpu", devices=2, strategy=LLMParallelStrategy(**ds), plugins=[plugin], logger=False)
    assert BF16Precision  # imported for the plugins above


def test_deepspeed_refuses_double_precision() -> None:
    # It trained the fp32 module (weights 1.8e-7 from one process's float64 run, 6e-8 from its fp32 one).
    with pytest.raises(ValueError, match=r"precision='64-true' with sharding_backend='deepspeed'.*would be fp32"):
        Trainer(accelerator="cpu", devices=2, precision="64-true", logger=False,
                strategy=LLMParallelStrategy(sharding_backend="deepspeed", zero_stage=2))


# ----------------------------------------------------------------------------------------- padding


def _same_training(ref: dict[str, Any], outs: list[dict[str, Any]]) -> None:
    """First-step gradients and the weights after every step equal one process's (the logged losses are each
    rank's or microbatch's own means, so they are not compared)."""
    for out in outs:
        assert "error" not in out, out["error"]
    grads: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    for out in outs:
        grads.update(out["grads"])
        params.update(out["params"])
    assert sorted(grads) == sorted(ref["grads"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=f"grad {name}")
    for name, p in ref["params"].items():
        torch.testing.assert_close(params[name], p, atol=5e-5, rtol=0, msg=f"param {name}")


def test_padded_batches_token_exact_under_every_layout() -> None:
    # Right-padded samples of random lengths: microbatches and data-parallel ranks hold different numbers of
    # valid tokens. loss_normalization='tokens' gives one process's mean over all valid tokens of the batch.
    opts = {"padded": True, "steps": 4}
    ref = _cases(1, [("llama", None, opts)])[0][0]
    tokens = {"loss_normalization": "tokens"}
    two = _cases(2, [("llama", {**tokens, "zero_stage": 3}, opts), ("llama", {**tokens, "pipeline_parallel": 2}, opts),
                     # 2 ranks x 2 accumulated micro-steps x 2 samples = the one-process batch of 8
                     ("llama", {**tokens, "zero_stage": 2}, {**opts, "accumulate": 2, "batch": 2}),
                     # tensor parallelism: both ranks read the whole batch of 8, or 2 accumulated micro-steps of 4
                     ("llama", {"tensor_parallel": 2}, opts),
                     ("llama", {**tokens, "tensor_parallel": 2}, {**opts, "accumulate": 2, "batch": 4}),
                     ("llama", {"zero_stage": 3}, opts)])
    for outs in two[:5]:
        _same_training(ref, outs)
    # The default (a mean of per-rank means, as DDP) trains differently on padded data: what the option is for.
    with pytest.raises(AssertionError):
        _same_training(ref, two[5])
    # ... and says so once, on rank 0, where the layout cuts the batch (not under tensor parallelism alone).
    said = [[w for w in out["warnings"] if "ignored targets" in w] for outs in two for out in outs]
    assert said[10] and "2 data-parallel ranks" in said[10][0] and "loss_normalization='tokens'" in said[10][0]
    assert len(said[10]) == 1 and not any(said[:10] + said[11:]), said


def test_padded_evaluation_under_the_default_mean_says_how_it_differs() -> None:
    # A pipeline's validation loss is the mean of its microbatches' means under "mean" (NaN for a microbatch without
    # a valid target), unlike one process's over the batch's valid targets: said once, as for training batches.
    (outs,) = _cases(2, [("llama", {"pipeline_parallel": 2}, {"padded": True, "steps": 1, "validate": True})])
    said = [w for w in outs[0]["warnings"] if "an evaluation batch has ignored targets" in w]
    assert len(said) == 1 and "microbatches" in said[0] and "NaN" in said[0], outs[0]["warnings"]
    assert not any("an evaluation batch" in w for w in outs[1]["warnings"])  # rank 0 only


def test_a_loss_ignoring_the_pad_token_is_counted_as_it_ignores() -> None:
    # A loss of one's own with ignore_index=0 over labels padded with the pad token: "tokens" counted every label
    # that was not -100, the pads too, and silently trained as "mean" does (weights 1.1e-2 off at dp2 ZeRO-3);
    # "mean" said nothing of the padding. The index is read from the loss's calls.
    opts = {"padded": "pad_token", "steps": 3}
    (ref,) = _cases(1, [("pad_token_loss", None, opts)])[0]
    tokens = {"loss_normalization": "tokens"}
    outs = _cases(2, [("pad_token_loss", {**tokens, "zero_stage": 3}, opts),
                      ("pad_token_loss", {**tokens, "pipeline_parallel": 2}, opts),
                      ("pad_token_loss", {**tokens, "tensor_parallel": 2, "loss_parallel": True},
                       {**opts, "accumulate": 2, "batch": 4}),
                      ("pad_token_loss", {"zero_stage": 3}, opts),
                      # optimized by hand: the step's optimizer step comes before the index is known
                      ("pad_token_loss", {**tokens, "zero_stage": 3}, {**opts, "manual": True, "clip": 1.0})])
    (manual_ref,) = _cases(1, [("pad_token_loss", None, {**opts, "manual": True, "clip": 1.0})])[0]
    _same_training(manual_ref, outs[4])
    for i, two in enumerate(outs[:3]):
        _same_training(ref, two)
        if i < 2:  # (under accumulation a micro-step logs its own half of the batch)
            assert two[1]["metrics"][-1]["train_loss"] == pytest.approx(ref["metrics"][-1]["train_loss"], abs=1e-5)
    said = [w for w in outs[3][0]["warnings"] if "ignored targets" in w]
    assert len(said) == 1 and "(0, the loss's ignore_index" in said[0], outs[3][0]["warnings"]


def test_transformers_told_the_pad_token_as_ignore_index_under_context_parallelism() -> None:
    # model(..., ignore_index=0): transformers pads the shifted labels with that index. The cut padded them with
    # -100 instead, a target cross-entropy refuses; each cp rank now gets the loss's index there, and counts it ignored.
    opts = {"padded": "pad_token", "steps": 3}
    (ref,) = _cases(1, [("pad_token_kwarg", None, opts)])[0]
    outs = _cases(2, [("pad_token_kwarg", {"context_parallel": 2}, opts),
                      ("pad_token_kwarg", {"context_parallel": 2, "loss_normalization": "tokens"}, opts)])
    for two in outs:
        _same_training(ref, two)


def test_a_validation_loss_ignoring_another_index_than_training_is_counted_as_it_ignores() -> None:
    # Training ignores -100 and settles the index; validation's loss ignores the pad token. Its steps were no longer
    # watched, so "tokens" weighed the ranks' and microbatches' validation means counting the pads (val_loss 4.1707
    # at dp2 ZeRO-3 and 4.1855 at pp2 where one process logs 4.1763). Evaluation's own index is read from its calls.
    opts = {"padded": "pad_token", "steps": 2, "validate": True}
    (ref,) = _cases(1, [("pad_token_validation", None, opts)])[0]
    tokens = {"loss_normalization": "tokens"}
    outs = _cases(2, [("pad_token_validation", {**tokens, "zero_stage": 3}, opts),
                      ("pad_token_validation", {**tokens, "pipeline_parallel": 2}, opts)])
    for two in outs:
        _same_training(ref, two)
        assert two[-1]["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-5), (two[-1]["val_loss"], ref["val_loss"])


def test_two_losses_over_as_many_targets_ignoring_different_indexes_are_refused_under_tokens() -> None:
    # Which of them counts the step's tokens cannot be told: the first called won, and weighed the step by the
    # second label set's count (weights 0.11 off one process at dp2 ZeRO-3). "mean" does not count: it runs.
    opts = {"padded": True, "steps": 1}
    outs = _cases(2, [("two_label_sets", {"zero_stage": 3, "loss_normalization": "tokens"}, opts),
                      ("two_label_sets", {"zero_stage": 3}, opts)])
    for out in outs[0]:
        assert "ValueError: The training step's loss calls ignore different targets (ignore_index=-1 and -100)" in out["error"]
    assert all("error" not in out for out in outs[1])


def test_transformers_item_count_in_the_batch_is_shared_by_pipeline_microbatches() -> None:
    # A collate function that puts transformers' num_items_in_batch (the batch's valid targets) into the batch, as
    # its Trainer computes it: every pipeline microbatch divided its sum by the whole batch's count (logged loss
    # 1.04 against 4.15 at pp2, weights 0.10 off). Each now divides by its share, and equals one process.
    opts = {"padded": "item_count", "steps": 3}
    (ref,) = _cases(1, [("llama", None, opts)])[0]
    outs = _cases(2, [("llama", {"pipeline_parallel": 2}, opts),
                      ("llama", {"pipeline_parallel": 2, "loss_normalization": "tokens"}, opts)])
    for two in outs:
        _same_training(ref, two)
        assert two[1]["metrics"][-1]["train_loss"] == pytest.approx(ref["metrics"][-1]["train_loss"], abs=1e-5)


def test_step_guard_keeps_a_step_where_one_rank_has_no_valid_target() -> None:
    # Samples 0, 2, 4 and 6 are all prompt (labels -100): data-parallel rank 0's part of the first batch has no
    # target, its own loss is 0/0 and weighs nothing under "tokens". StepGuard judged that NaN and skipped a good
    # step on every rank (weights 0.70 off one process); it reads the global batch's loss.
    opts = {"padded": "ignored", "steps": 3}
    (ref,) = _cases(1, [("llama", None, opts)])[0]
    (two,) = _cases(2, [("llama", {"zero_stage": 3, "loss_normalization": "tokens"}, {**opts, "guard": True})])
    assert all(not out["skipped_steps"] for out in two), [out["skipped_steps"] for out in two]
    _same_training(ref, two)


def test_manual_optimization_under_tokens_that_cannot_be_rescaled_is_refused() -> None:
    # One rescale per training step: a second optimizer's gradients stayed weighted by the tokens (0.71 off one
    # process), gradients accumulated by hand over two steps (or a step without backward) were divided by one
    # step's share; StepGuard read the token-weighted loss. Each is refused, naming the way out.
    from lightning_llmpar import StepGuard
    from tests.workloads import fit_error

    tokens = {"zero_stage": 3, "loss_normalization": "tokens"}
    cases = [("gpt_two_optimizers_by_hand", {}, "with 2 optimizers"),
             ("gpt_accumulates_by_hand", {}, "this optimizer step follows 2 training steps"),
             ("gpt_by_hand", {"callbacks_extra": [StepGuard()]}, "StepGuard judges the loss a backward gets")]
    for model, extra, words in cases:
        errors = run_ranks(fit_error, 2, model, tokens, steps=2, batch_size=4, **extra)
        assert all(e is not None and "ValueError" in e and words in e for e in errors), errors


def test_a_term_on_an_intermediate_hidden_state_is_exact_or_refused() -> None:
    # output_hidden_states=True under sequence parallelism recorded each rank's part of the sequence for every block
    # (weights 6.3e-4 off one process); under pipeline parallelism the last stage's hidden_states[1] was its first
    # own block's input. The term reads hidden_states[2], the input of the last stage's first block (1F1B, 4 layers).
    opts = {"steps": 3}
    (ref,) = _cases(1, [("hidden_states_loss", None, opts)])[0]
    sp, pp = {"tensor_parallel": 2}, {"pipeline_parallel": 2, "pipeline_schedule": "1F1B"}
    (checkpointed,) = _cases(1, [("reentrant_checkpointing", None, opts)])[0]
    outs = _cases(2, [("hidden_states_loss", sp, opts), ("hidden_states_loss", pp, opts),
                      # transformers' own gradient checkpointing, reentrant: a stage's backward(inputs=...) failed
                      ("reentrant_checkpointing", pp, opts)])
    # Both: the stage's states gathered (tp2 x pp2 gathered none of them once placed at their indices).
    outs += _cases(4, [("hidden_states_loss", {**sp, **pp}, opts)])
    for reference, two in zip([ref, ref, checkpointed, ref], outs):
        _same_training(reference, two)
    # Interleaved, the last stage holds block 3 alone: the split check says so (it blamed the cut).
    (interleaved,) = _cases(2, [("hidden_states_loss", {"pipeline_parallel": 2}, opts)])
    errors = [out.get("error", "") for out in interleaved]
    assert all("hidden_states[2]" in e and "blocks 3 on" in e and "Cut elsewhere" not in e for e in errors), errors
    # Earlier stages' states are not there: reading one says so.
    from lightning_llmpar.modeling.hidden_states import StageHiddenStates

    states = StageHiddenStates((torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)), 2)
    assert len(states) == 5 and float(states[2]) == 0 and float(states[-1]) == 2 and len(states[2:]) == 3
    # Walked (Lightning's and the pipeline's own walks over a step's outputs): None where absent, and rebuilt alike.
    assert list(states)[:2] == [None, None] and StageHiddenStates(list(states)).first == 2
    for read in (lambda: states[1], lambda: states[:3]):
        with pytest.raises(ValueError, match=r"holds blocks 2 on, so it has hidden states 2 to 4.*pipeline_parallel=1"):
            read()


def test_labels_that_are_every_target_are_counted_whole_under_tokens() -> None:
    # T5's labels are its decoder's targets and BERT's masked-LM labels are every position's: "tokens" counted them
    # as a causal LM's, shifted by one (a sample fewer per row), and trained to other weights (1e-3 at dp2 ZeRO-3).
    opts = {"padded": True, "steps": 3}
    models = ["t5", "bert_mlm"]
    refs = _cases(1, [(m, None, opts) for m in models])
    outs = _cases(2, [(m, {"loss_normalization": "tokens", "zero_stage": 3}, opts) for m in models]
                  # BERT's prediction head keeps an alias of its decoder's bias: the plan refused the tie, a parent's
                  # alias left whole beside the split decoder.
                  + [("bert_mlm", {"tensor_parallel": 2}, opts)])
    for ref, two in zip([r for (r,) in refs] + [refs[1][0]], outs):
        _same_training(ref, two)


def test_a_frozen_teacher_larger_than_the_student_is_not_the_stack_the_layout_splits() -> None:
    # Distillation: the frozen teacher (twice the student's width) was taken for the block stack, being the largest:
    # pipeline parallelism split the teacher and refused the student as "modules before the stack", and tensor
    # parallelism split the teacher, leaving the trained student whole on every rank.
    from lightning_llmpar.modeling.structure import find_block_stack
    from tests.custom_models import Distilled

    stack = find_block_stack(Distilled())
    assert stack is not None and stack.prefix == "student.model.layers"
    opts = {"steps": 3}
    refs = _cases(1, [(m, None, opts) for m in ("distilled", "distilled_teacher_first")])
    # A teacher run before the student's blocks runs on every pipeline rank (its logits are the loss's): 1F1B.
    outs = _cases(2, [("distilled", {"pipeline_parallel": 2}, opts), ("distilled", {"tensor_parallel": 2}, opts),
                      ("distilled_teacher_first", {"pipeline_parallel": 2, "pipeline_schedule": "1F1B"}, opts)])
    for ref, two in zip([refs[0][0], refs[0][0], refs[1][0]], outs):
        _same_training(ref, two)


# ----------------------------------------------------------------------------------------- dropout


class _DropBlock(nn.Module):
    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential()
        self.mlp.up_proj = nn.Linear(width, 4 * width)
        self.mlp.act = nn.GELU()
        self.mlp.drop = nn.Dropout(p)  # on this rank's features: independent per rank
        self.mlp.down_proj = nn.Linear(4 * width, width)
        self.resid_drop = nn.Dropout(p)  # on the residual stream: replicated (or token-sharded under SP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.resid_drop(self.mlp(self.norm(x)))


class _DropModel(LightningModule):
    def __init__(self, p: float = 0.3, checkpointing: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(_DropBlock(32, p) for _ in range(2))
        self.head = nn.Linear(32, 64)
        self.masks: dict[str, list[torch.Tensor]] = {}
        for name, m in self.named_modules():
            if isinstance(m, nn.Dropout):
                m.register_forward_hook(lambda mod, i, o, name=name: self.masks.setdefault(name, []).append((o == 0).cpu()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _FirstGrads(Callback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if not self.grads:
            from tests.zoo import full

            self.grads = {n: full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}


def _dropout_run(sequence_parallel: bool, checkpointing: bool, layout: dict[str, Any] | None = None) -> dict[str, Any]:
    import os

    from lightning_llmpar import ActivationCheckpointing

    seed_everything(0, verbose=False)
    module, record = _DropModel(), _FirstGrads()
    callbacks: list[Callback] = [record] + ([ActivationCheckpointing(mode="full")] if checkpointing else [])
    trainer = Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=1, logger=False,
                      strategy=LLMParallelStrategy(**(layout or {"tensor_parallel": 2, "sequence_parallel": sequence_parallel})),
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 64, (8, 16), generator=g)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(list(zip(x, torch.roll(x, 1, 1))), batch_size=8))
    forward = {k: v[0] for k, v in module.masks.items()}  # the first call of each (recomputation calls again)
    return {"masks": forward, "grads": record.grads, "calls": {k: len(v) for k, v in module.masks.items()},
            "every": module.masks}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no-sp", "sp"])
def test_dropout_streams_per_rank_where_data_is_sharded(sequence_parallel: bool) -> None:
    outs = run_ranks(_dropout_run, 2, sequence_parallel, False)
    a, b = (o["masks"] for o in outs)
    for name in a:
        assert abs(float(a[name].float().mean()) - 0.3) < 0.05, (name, float(a[name].float().mean()))
    # Features of the MLP differ per rank: independent masks (agreement ~ 1 - 2p(1-p) = 0.58, not 1).
    for layer in ("blocks.0.mlp.drop", "blocks.1.mlp.drop"):
        agree = float((a[layer] == b[layer]).float().mean())
        assert 0.45 < agree < 0.7, (layer, agree)
    assert not torch.equal(a["blocks.0.mlp.drop"], a["blocks.1.mlp.drop"]), "each layer draws its own mask"
    resid = ("blocks.0.resid_drop", "blocks.1.resid_drop")
    if sequence_parallel:  # token shards: independent too
        assert all(float((a[n] == b[n]).float().mean()) < 0.7 for n in resid)
    else:  # the replicated residual stream: the same mask on every rank, or the replicas would diverge
        assert all(torch.equal(a[n], b[n]) for n in resid)


def test_pipeline_stages_draw_their_own_dropout_masks() -> None:
    # Every rank starts on the seed seed_everything gave it: block 1 on the second stage drew, microbatch for
    # microbatch, the masks block 0 drew on the first (one process draws them independently).
    first, second = run_ranks(_dropout_run, 2, False, False, {"pipeline_parallel": 2, "pipeline_schedule": "1F1B"})
    for name in ("mlp.drop", "resid_drop"):  # the 4 microbatches of the step (the split check ran before)
        a, b = first["every"][f"blocks.0.{name}"][-4:], second["every"][f"blocks.1.{name}"][-4:]
        assert all(x.shape == y.shape == (2, 16, 128 if name == "mlp.drop" else 32) for x, y in zip(a, b))
        agree = [float((x == y).float().mean()) for x, y in zip(a, b)]
        assert all(0.45 < v < 0.7 for v in agree), (name, agree)  # independent: ~1 - 2p(1-p) = 0.58


def test_dropout_recomputed_under_checkpointing_draws_the_same_masks() -> None:
    plain = run_ranks(_dropout_run, 2, True, False)
    recomputed = run_ranks(_dropout_run, 2, True, True)
    assert recomputed[0]["calls"]["blocks.0.mlp.drop"] == 2  # forward and recomputation
    for p, r in zip(plain, recomputed):
        for name, grad in p["grads"].items():
            torch.testing.assert_close(r["grads"][name], grad, atol=1e-6, rtol=0, msg=name)


# ------------------------------------------------------------------- the inner model called outside a step
class _SampleAtEpochEnd(Callback):
    """Logits of the inner model at each training epoch's end, as a sampling callback would compute them."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x, self.logits = x, []

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        with torch.no_grad():
            self.logits.append(pl_module.model(input_ids=self.x).logits)


def _inner_model_outside_the_step(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    from tests.workloads import full
    from tests.zoo import DictTokenData, HFCausalLM, Record

    seed_everything(0)
    module = HFCausalLM("llama_tied", frozen="attention")  # SGD, tied, frozen attention projections
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    sample, record = _SampleAtEpochEnd(x), Record()
    trainer = Trainer(accelerator="cpu", devices=1 if kwargs is None else 2, max_epochs=2, limit_train_batches=2,
                      strategy="auto" if kwargs is None else LLMParallelStrategy(**kwargs), callbacks=[sample, record],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0)
    # The same global batches of 8 right-padded dict rows: rank r of dp2 takes rows r, r + 2, ...
    trainer.fit(module, datamodule=DictTokenData(8 if kwargs is None else 4, padded=True))
    with torch.no_grad():
        generated = module.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False,
                                          pad_token_id=0)
    return {"sampled": [full(t) for t in sample.logits], "generated": generated,
            "logged": [m["train_loss"] for m in record.metrics]}


# Padded rows: "tokens" makes the data-parallel ranks' loss one process's mean over the batch's valid targets.
@pytest.mark.parametrize("kwargs", [{"zero_stage": 3, "loss_normalization": "tokens"},
                                    {"zero_stage": 2, "loss_normalization": "tokens"}], ids=["dp2-zero3", "dp2-zero2"])
def test_the_inner_model_called_outside_a_step_is_one_process_model(kwargs: dict[str, Any]) -> None:
    # A callback sampling from pl_module.model, or generate() after fit: the model's embeddings, norm and head were
    # the root's, gathered only around the root's forward, and the call failed under ZeRO ("aten.embedding.default
    # got mixed torch.Tensor and DTensor"). They are now a unit of their own and the call gives one process's logits.
    ref = run_ranks(_inner_model_outside_the_step, 1, None)[0]
    assert len(ref["logged"]) == 4 and len(ref["sampled"]) == 2  # two epochs of two steps
    for out in run_ranks(_inner_model_outside_the_step, 2, kwargs):
        for got, want in zip(out["sampled"], ref["sampled"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(out["generated"], ref["generated"])
        assert out["logged"] == pytest.approx(ref["logged"], abs=1e-5)  # the loss the user reads, step by step
