"""Pure data parallelism at ZeRO-0 in full precision runs on DDP (data_parallel.replicate) and trains like one
process on the same global batches, on third-party models and the way users train; every other layout and
precision keeps FSDP2."""

from __future__ import annotations

import shutil
from collections import Counter
from functools import cache
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from tests.distributed import run_ranks
from tests.zoo import assert_exact, fit_cases

pytest.importorskip("transformers")

# (model, strategy kwargs, options); 2 ranks, 4 samples each (2 x 2 accumulated), one process 8.
DDP_CASES = [
    ("llama", {}, {"tag": "plain"}),
    ("gpt2", {}, {"tag": "tied"}),
    ("mixtral", {}, {"tag": "moe"}),
    ("litgpt_llama", {}, {"tag": "litgpt"}),
    # Three of the four blocks feed nothing the loss reads: no gradient for them (find_unused_parameters).
    ("unchained", {}, {"tag": "unused"}),
    ("llama", {}, {"tag": "accumulate_clip", "accumulate": 2, "clip": 1.0, "batch": 2}),
    ("llama", {}, {"tag": "lora_clip", "frozen": "lora", "clip": 1.0}),
    ("llama", {}, {"tag": "selective", "checkpointing": "selective"}),
    ("llama", {"loss_normalization": "tokens"}, {"tag": "padded_tokens", "padded": True}),
    # Manual optimization: backward, clipping and the step inside the training step, so inside DDP's forward.
    ("llama", {}, {"tag": "manual_clip", "manual": True, "clip": 1.0}),
    ("gpt2", {}, {"tag": "manual_tied", "manual": True, "clip": 1.0}),
    # Compiled blocks inside DDP's forward (inductor compiles C++ on CPU).
    *([("llama", {"compile": True}, {"tag": "compiled", "checkpointing": "full"})] if shutil.which("g++") else []),
]
FSDP2_CASES = [
    ("llama", {}, {"tag": "bf16_mixed", "precision": "bf16-mixed"}),  # FSDP2 casts the parameters
    ("llama", {"zero_stage": 1}, {"tag": "zero1"}),
    ("llama", {"gradient_compression": "fp16"}, {"tag": "compressed"}),
]
# Dropout: masks differ from one process's, so the replicas are compared with each other instead.
DROPOUT = [("gpt2", {}, {"tag": "dropout", "dropout": 0.1})]
# Manual optimization on the FSDP2 paths, against one process too.
FSDP2_MANUAL = [
    ("llama", {"zero_stage": 3}, {"tag": "manual_zero3", "manual": True, "clip": 1.0}),
    ("qwen3", {"tensor_parallel": 2}, {"tag": "manual_tp2", "manual": True, "clip": 1.0, "batch": 8}),
    ("mixtral", {"expert_parallel": 2}, {"tag": "manual_ep2", "manual": True, "clip": 1.0}),
]


def _data(options: dict[str, Any]) -> dict[str, Any]:
    """The options that change what one process trains."""
    return {k: v for k, v in options.items() if k in ("frozen", "padded", "clip", "manual")}


def _ref_key(name: str, options: dict[str, Any]) -> str:
    return name + "".join(f"_{k}={v}" for k, v in sorted(_data(options).items()))


@cache
def results() -> tuple[dict[str, Any], dict[str, list[Any]]]:
    exact = DDP_CASES + FSDP2_MANUAL
    wanted = {_ref_key(n, o): (n, _data(o)) for n, _, o in exact}
    refs = run_ranks(fit_cases, 1, [(n, None, 8, {**d, "tag": key}) for key, (n, d) in wanted.items()])[0]
    cases = [(n, k, o.get("batch", 4), {kk: v for kk, v in o.items() if kk != "batch"}) for n, k, o in exact + FSDP2_CASES + DROPOUT]
    outs = run_ranks(fit_cases, 2, cases, timeout=900)
    ref_of = {o["tag"]: refs[(n, _ref_key(n, o))] for n, _, o in exact}
    return ref_of, {o["tag"]: [r[(n, o["tag"])] for r in outs] for n, _, o in exact + FSDP2_CASES + DROPOUT}


@pytest.mark.parametrize("tag", [o["tag"] for _, _, o in DDP_CASES])
def test_pure_data_parallelism_runs_on_ddp_like_one_process(tag: str) -> None:
    refs, runs = results()
    outs = runs[tag]
    assert all(o.get("data_parallel") == "ddp" for o in outs), [o.get("data_parallel", o.get("error")) for o in outs]
    if tag == "compiled":
        assert all(o["compiled_extern_calls"] > 0 for o in outs), "the blocks ran compiled code"
    if tag in ("padded_tokens", "accumulate_clip"):  # losses are per rank and microbatch: compare what is trained
        from tests.test_real_setups import _same_training

        _same_training(refs[tag], outs)
    else:
        assert_exact(refs[tag], outs, sharded=False)


@pytest.mark.parametrize("tag", [o["tag"] for _, _, o in FSDP2_MANUAL])
def test_manual_optimization_on_fsdp2_layouts_matches_one_process(tag: str) -> None:
    refs, runs = results()
    assert all(o.get("data_parallel") == "fsdp2" or "tp2" in tag for o in runs[tag])
    assert_exact(refs[tag], runs[tag], sharded=False)


@pytest.mark.parametrize("tag", [o["tag"] for _, _, o in FSDP2_CASES])
def test_layouts_that_need_fsdp2_keep_it(tag: str) -> None:
    _, runs = results()
    assert all("error" not in o for o in runs[tag]), runs[tag][0].get("error")
    assert all(o["data_parallel"] == "fsdp2" for o in runs[tag])


def _all_reduces(accumulate: int, steps: int) -> int:
    """gloo all-reduces (DDP's reducer calls them from C++) in ``steps`` optimizer steps of pure data parallelism."""
    from lightning_llmpar import LLMParallelStrategy
    from tests.zoo import DictTokenData, HFCausalLM

    class Profile(Callback):  # from the first training step on: no state broadcast, no sanity check
        def on_train_start(self, *args: Any) -> None:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()

        def on_train_end(self, *args: Any) -> None:
            self.prof.__exit__(None, None, None)

    profile = Profile()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=LLMParallelStrategy(), max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, accumulate_grad_batches=accumulate, callbacks=[profile],
                      num_sanity_val_steps=0)
    trainer.fit(HFCausalLM("llama"), datamodule=DictTokenData(2))
    return Counter(e.key for e in profile.prof.events())["gloo:all_reduce"]


def test_accumulated_microbatches_reduce_gradients_once_per_optimizer_step() -> None:
    steps, accumulate = 3, 4
    once, accumulated = (run_ranks(_all_reduces, 2, a, steps)[0] for a in (1, accumulate))
    # Besides the gradients, each batch's loss is reduced once for the logs (training.logged_loss: two numbers): the
    # extra micro-batches add exactly that, where a gradient sync per micro-batch would add a bucket's worth each.
    assert once > 0 and accumulated == once + steps * (accumulate - 1), (once, accumulated)


def test_dropout_on_ddp_keeps_the_replicas_identical() -> None:
    _, runs = results()
    first, second = runs["dropout"]
    assert first["data_parallel"] == second["data_parallel"] == "ddp"
    assert first["losses"][0] != runs["tied"][0]["losses"][0], "dropout was active (same model and data without it)"
    for name, param in first["params"].items():
        torch.testing.assert_close(second["params"][name], param, atol=0, rtol=0, msg=name)
