"""Expert parallelism reproduces one process: every MoE layer's experts split over data-parallel ranks, tokens
sent to them and back with all-to-all; alone and with ZeRO-3, tensor and pipeline parallelism, on transformers'
Mixtral and Qwen3-MoE and on the example GPT's MoE option.

Cases of one world size share a launch; each one-process reference is computed once.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.expert_parallel import apply_expert_parallel
from lightning_llmpar.expert_parallel.dispatch import route
from lightning_llmpar.models.gpt import GPT, GPTConfig
from tests.distributed import run_ranks
from tests.zoo import SEQ, assert_exact, fit_cases

pytest.importorskip("transformers")

STEPS = 8
EP2 = {"expert_parallel": 2}
# (model, strategy kwargs, per-rank batch, options); the global batch is 8 everywhere.
CASES: dict[int, list[tuple]] = {
    2: [
        ("gpt_moe", EP2, 4, {"tag": "ep2"}),
        ("mixtral", EP2, 4, {"tag": "ep2"}),
        ("qwen3_moe", dict(EP2, zero_stage=3), 4, {"tag": "ep2_zero3"}),
        # 4 x the even share: no expert can overflow (a token picks an expert once), so nothing drops
        ("gpt_moe", dict(EP2, expert_capacity_factor=4.0), 4, {"tag": "ep2_capacity"}),
        ("gpt_moe", dict(EP2, expert_capacity_factor=0.5), 4, {"tag": "ep2_drops", "reference": False}),
        ("gpt_moe", {"expert_capacity_factor": 4.0}, 4, {"tag": "ep1_capacity"}),  # the cut without the split
        # each context-parallel rank routes its part of every sequence: the metrics count both parts
        ("mixtral", {"expert_capacity_factor": 4.0, "context_parallel": 2}, 8, {"tag": "cp2_capacity"}),
        ("qwen2_moe", EP2, 4, {"tag": "ep2"}),  # a shared expert beside the routed ones
        ("gpt_oss", EP2, 4, {"tag": "ep2"}),  # experts (E, in, out) with biases, interleaved gate/up columns
        # recomputation in backward routes the tokens again (the same way)
        ("gpt_moe", EP2, 4, {"tag": "ep2_checkpointing", "checkpointing": "full"}),
        # LoRA on attention, experts and router frozen: the way MoE models are often fine-tuned
        ("qwen3_moe", EP2, 4, {"tag": "ep2_lora", "frozen": "lora"}),
        # Tied embeddings, right-padded dict batches (pad tokens are routed too, as in one process), token-mean
        # loss. Ranks hold unequal valid targets, so each logs its own mean: weights are compared.
        ("mixtral_tied", dict(EP2, loss_normalization="tokens"), 4,
         {"tag": "ep2_tied_padded_tokens", "padded": True, "weights_only": True}),
    ],
    4: [
        ("mixtral", dict(EP2, tensor_parallel=2), 4, {"tag": "ep2_tp2"}),
        ("gpt_oss", dict(EP2, tensor_parallel=2), 4, {"tag": "ep2_tp2"}),  # the down bias: its 1/tp share per rank
        ("qwen3_moe", dict(EP2, zero_stage=3), 2, {"tag": "ep2_dp4_zero3"}),  # experts sharded over the other 2
        ("gpt_moe", dict(EP2, pipeline_parallel=2), 4, {"tag": "ep2_pp2"}),
        # one stage per rank, accumulating: the experts' own FSDP units keep the first micro-step's gradients too
        ("gpt_moe", dict(EP2, pipeline_parallel=2, pipeline_schedule="1F1B"), 4,
         {"tag": "ep2_pp2_1f1b_accumulate", "accumulate": 2}),
    ],
    8: [("mixtral", dict(EP2, tensor_parallel=2, pipeline_parallel=2, zero_stage=2), 4, {"tag": "ep2_tp2_pp2_zero2"})],
}
EXACT = [(w, c[0], c[3]["tag"]) for w, cases in CASES.items() for c in cases if c[3].get("reference", True)]


def _options(world: int, name: str, tag: str) -> dict[str, Any]:
    return next(c[3] for c in CASES[world] if c[0] == name and c[3]["tag"] == tag)


# What the one-process reference shares with a case: the model, its data and how it trains (not the layout).
_DATA = ("padded", "frozen", "accumulate")


def _reference_key(name: str, options: dict[str, Any]) -> str:
    return f"{name} {sorted((k, v) for k, v in options.items() if k in _DATA)}"


@cache
def references() -> dict[tuple[str, str], Any]:
    wanted = {}
    for world, name, tag in EXACT:
        options = _options(world, name, tag)
        key = _reference_key(name, options)
        wanted[key] = (name, None, 8, {**{k: v for k, v in options.items() if k in _DATA}, "steps": STEPS, "tag": key})
    return run_ranks(fit_cases, 1, list(wanted.values()), timeout=900)[0]


@cache
def results(world: int) -> list[dict[tuple[str, str], Any]]:
    cases = [(name, kwargs, batch, {**{k: v for k, v in options.items() if k not in ("reference", "weights_only")},
                                     "steps": STEPS})
             for name, kwargs, batch, options in CASES[world]]
    return run_ranks(fit_cases, world, cases, timeout=1200)


@pytest.mark.parametrize("world, name, tag", EXACT)
def test_expert_parallel_is_exact(world: int, name: str, tag: str) -> None:
    options = _options(world, name, tag)
    outs = [r[(name, tag)] for r in results(world)]
    ref = references()[(name, _reference_key(name, options))]
    if options.get("weights_only"):
        from tests.test_real_setups import _same_training

        _same_training(ref, outs)
    else:
        assert_exact(ref, outs, sharded=False)
    if "ep2" in tag:  # the experts are split: no rank holds all of the model
        assert all(o["held"] < 0.9 for o in outs), [o["held"] for o in outs]


def _routing(run: dict[str, Any]) -> list[dict[str, float]]:
    return [{k: v for k, v in m.items() if k.startswith("moe/")} for m in run["metrics"]]


def test_routing_metrics_count_every_assignment() -> None:
    outs = [r[("gpt_moe", "ep2")] for r in results(2)]
    per_step = 8 * SEQ * 2 * 4  # tokens x top-2 x 4 MoE layers
    for out in outs:
        for metrics in out["metrics"]:
            assert sum(v for k, v in metrics.items() if k.startswith("moe/expert_")) == per_step
            assert metrics["moe/dropped_tokens"] == 0 and metrics["moe/imbalance"] >= 1
            assert metrics["ep/bytes_sent"] > 0
    assert _routing(outs[0]) == _routing(outs[1])  # all ranks
    # Activation checkpointing's recomputation routes again in backward; it is not counted twice.
    assert _routing(results(2)[0][("gpt_moe", "ep2_checkpointing")]) == _routing(outs[0])
    # Context-parallel ranks each route their part of the sequences: the counts are the whole batch's (were halved).
    assert _routing(results(2)[0][("mixtral", "cp2_capacity")]) == _routing(results(2)[0][("mixtral", "ep2")])


def test_routing_metrics_under_a_pipeline_count_each_step_once() -> None:
    # A stage's first run on placeholders, which teaches the schedule the shapes, routed them too: step 0 counted
    # 1280 assignments where every step has 1024 (and the bytes sent for them).
    per_step = 8 * SEQ * 2 * 4
    for out in (r[("gpt_moe", "ep2_pp2")] for r in results(4)):
        assert [sum(v for k, v in m.items() if k.startswith("moe/expert_")) for m in out["metrics"]] == [per_step] * STEPS


def test_capacity_drops_tokens_and_says_so() -> None:
    outs = [r[("gpt_moe", "ep2_drops")] for r in results(2)]
    for out in outs:
        assert "error" not in out, out.get("error")
        last = out["metrics"][-1]
        assert last["moe/dropped_tokens"] > 0 and 0 < last["moe/dropped_fraction"] < 1
        assert all(torch.isfinite(torch.tensor(loss)) for loss in out["losses"])


# ---------------------------------------------------------------------------------------------- pieces


def test_capacity_keeps_the_first_tokens_of_each_expert() -> None:
    index = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 3]])  # expert 0 is everyone's first choice
    weights = torch.full((4, 2), 0.5)
    routing = route(index, weights, num_experts=4, group=None, ep=1, capacity_factor=1.0)  # capacity 2
    assert routing.counts.tolist() == [4, 2, 1, 1] and routing.dropped == 2
    assert routing.tokens.tolist() == [0, 1, 0, 1, 2, 3]  # expert 0 keeps tokens 0 and 1
    assert routing.local_experts.tolist() == [0, 0, 1, 1, 2, 3]


def test_aux_loss_reaches_the_router() -> None:
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=16, n_expert=4))
    model(torch.randint(0, 32, (2, 8)))
    aux = model.aux_loss()
    aux.backward()
    assert aux.item() > 0 and model.layers[0].mlp.router.weight.grad.abs().sum() > 0


def test_model_without_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="GPT has none"):
        apply_expert_parallel(GPT(GPTConfig(n_layer=1)), None, 1.25)


def test_experts_not_divisible_by_ep_are_refused() -> None:
    from lightning_llmpar.expert_parallel.apply_ep import check_experts, find_experts

    model = GPT(GPTConfig(n_layer=1, n_expert=3))
    with pytest.raises(ValueError, match=r"has 3 experts, not divisible by expert_parallel\(2\)"):
        check_experts(find_experts(model), 2)


def test_bad_combinations_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="expert_parallel=2 does not combine with context_parallel"):
        LLMParallelStrategy(expert_parallel=2, context_parallel=2)
    with pytest.raises(ValueError, match="pipeline_schedule='ZBVZeroBubble'"):
        LLMParallelStrategy(expert_parallel=2, pipeline_parallel=2, pipeline_schedule="ZBVZeroBubble")
    with pytest.raises(ValueError, match="pipeline_schedule='dualpipev'"):  # schedule names are case-insensitive
        LLMParallelStrategy(expert_parallel=2, pipeline_parallel=2, pipeline_schedule="dualpipev")
    with pytest.raises(ValueError, match="expert_capacity_factor"):
        LLMParallelStrategy(expert_capacity_factor=0)
    with pytest.raises(ValueError, match="positive integer"):
        LLMParallelStrategy(expert_parallel=0)


def test_ep_not_dividing_the_data_parallel_ranks_is_refused_before_launch() -> None:
    from lightning.pytorch import Trainer

    with pytest.raises(ValueError, match=r"expert_parallel\(4\) must divide .* dp_replicate\(2\)"):
        Trainer(accelerator="cpu", devices=2, strategy=LLMParallelStrategy(expert_parallel=4), logger=False)
    with pytest.raises(ValueError, match=r"expert_parallel\(2\) must divide .* dp_shard\(1\)"):
        Trainer(accelerator="cpu", devices=2, logger=False,
                strategy=LLMParallelStrategy(expert_parallel=2, zero_stage=3, data_parallel_replicate=2))


# ---------------------------------------------------------------------------------------------- checkpoints


def test_pretrained_weights_in_and_out_and_resume_across_layouts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Mixtral from a transformers directory on the meta device (each rank reads its own experts), exported from
    ep2 as one process trains it; a Lightning checkpoint saved at ep2 (AdamW state too) resumes in one process
    and at tp2, continuing like one process's own save and resume."""
    from tests.zoo import logits_of, save_pretrained

    name, adam = "mixtral", {"sgd": False}
    run_ranks(save_pretrained, 1, name, str(tmp_path / "hf"))
    pretrained = {"pretrained": str(tmp_path / "hf"), "steps": 3}
    run_ranks(fit_cases, 1, [(name, None, 8, {**pretrained, "save_hf": str(tmp_path / "ref")}),
                             (name, None, 8, {**adam, "steps": 3, "save_to": str(tmp_path / "plain.ckpt"), "tag": "a"})])
    whole = run_ranks(fit_cases, 1, [(name, None, 8, {**adam, "steps": 6, "ckpt_path": str(tmp_path / "plain.ckpt")})])[0]
    outs = run_ranks(fit_cases, 2, [
        (name, EP2, 4, {**pretrained, "meta": True, "save_hf": str(tmp_path / "ep2")}),
        (name, EP2, 4, {**adam, "steps": 3, "save_to": str(tmp_path / "ep2.ckpt"), "tag": "save"}),
    ])
    for out in outs:
        assert all("error" not in r for r in out.values()), [r["error"] for r in out.values() if "error" in r]
    ours, theirs = run_ranks(logits_of, 1, str(tmp_path / "ep2"))[0], run_ranks(logits_of, 1, str(tmp_path / "ref"))[0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    for kwargs, world in (({}, 1), ({"tensor_parallel": 2}, 2)):
        resumed = run_ranks(fit_cases, world, [(name, kwargs, 8, {**adam, "steps": 6, "ckpt_path": str(tmp_path / "ep2.ckpt")})])
        results = [r[(name, repr(kwargs))] for r in resumed]
        for r in results:
            assert "error" not in r, r["error"]
        for i in range(3):
            loss = sum(r["losses"][i] for r in results) / len(results)
            assert abs(loss - whole[(name, "None")]["losses"][i]) < 1e-5, (kwargs, i, loss)


def _gpt_moe_with_aux_on_a_pipeline() -> str:
    from lightning.pytorch import Trainer, seed_everything

    from lightning_llmpar.models import GPTModule

    seed_everything(0, verbose=False)
    module = GPTModule(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_kv_head=1, n_embd=16, n_expert=4,
                       moe_aux_loss_coef=0.01)
    x = torch.randint(0, 32, (8, 17), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(list(zip(x[:, :-1], x[:, 1:])), batch_size=8)
    trainer = Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                      strategy=LLMParallelStrategy(pipeline_parallel=2, pipeline_schedule="1F1B"))
    try:
        trainer.fit(module, train_dataloaders=data)
    except ValueError as err:
        return str(err)
    return "trained"


def test_load_balancing_losses_under_a_pipeline_are_refused() -> None:
    # Computed on the last stage, they saw its layers only: transformers' over the last stage's router logits (the
    # first stage's routers got no gradient from it), the example GPT's over its own MoE layers (half the term at
    # pp2 under 1F1B; under the interleaved schedule a crash, summing a stale value of the rank's other stage).
    hf = run_ranks(fit_cases, 2, [("mixtral_aux", {"pipeline_parallel": 2}, 4)])
    assert all("output_router_logits=True" in out[("mixtral_aux", repr({"pipeline_parallel": 2}))]["error"]
               for out in hf)
    said = run_ranks(_gpt_moe_with_aux_on_a_pipeline, 2)
    assert any("the last forward ran 2 of 4" in s and "moe_aux_loss_coef=0" in s for s in said), said
    # Its own words, not wrapped in the split check's "stage 1 fails when run on its own (...)".
    assert all(s.startswith("The load-balancing loss sums") for s in said if s != "trained"), said
