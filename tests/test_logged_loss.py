"""The loss a user's step logs (``self.log("train_loss", loss)``, no ``sync_dist``) is what one process logs on the
same global batch, at every step, under context, pipeline, tensor, expert and data parallelism: through a user's
module here, through ``llmpar fit`` and its CSV log in tests/cli/test_cli.py.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from lightning_llmpar.training.logged_loss import captured_logs, is_the_loss
from tests.distributed import run_ranks
from tests.zoo import fit_cases

pytest.importorskip("transformers")

TOKENS = {"loss_normalization": "tokens"}
# (model, strategy kwargs, per-rank batch, options): the global batch is 8 everywhere. Padded batches give the ranks
# (and a context-parallel rank's parts of the sequences) different numbers of valid targets.
CASES = [
    ("llama", {"context_parallel": 2}, 8, {"tag": "cp2"}),
    ("titan_untied", {"context_parallel": 2}, 8, {"tag": "cp2"}),  # (inputs, targets) pairs, a ModuleDict stack
    # Validated too: each context-parallel rank holds part of every sequence, right padding mostly in the second.
    ("qwen3", {"context_parallel": 2}, 8, {"tag": "cp2_padded", "padded": True, "validate": True}),
    ("llama", {"pipeline_parallel": 2}, 8, {"tag": "pp2"}),
    ("titan_untied", {"pipeline_parallel": 2}, 8, {"tag": "pp2_float64", "precision": "64-true"}),  # not rounded to fp32
    # Validated after training too: the microbatches' validation losses weighed by their valid labels.
    ("qwen3", {"pipeline_parallel": 2, "pipeline_schedule": "1F1B", **TOKENS}, 8,
     {"tag": "pp2_tokens", "padded": True, "validate": True}),
    ("llama", {"tensor_parallel": 2}, 8, {"tag": "tp2"}),
    ("gpt_moe", {"expert_parallel": 2}, 4, {"tag": "ep2"}),
    ("mixtral", {"expert_parallel": 2}, 4, {"tag": "ep2"}),
    # Validated too: the ranks' validation losses (sync_dist) weighed by their valid labels, not the mean of means.
    ("qwen3", {"zero_stage": 3, **TOKENS}, 4, {"tag": "dp2_tokens", "padded": True, "validate": True}),
    ("llama", {"zero_stage": 0}, 4, {"tag": "dp2_replicated"}),  # DDP's hooks clone the step's output
    # A rank's or a microbatch's samples with every label ignored: their NaN mean (0/0) was weighed by zero tokens
    # into a NaN logged loss; the pipeline's check, on such a first sample, blamed the model's split.
    ("qwen3", {"zero_stage": 3, **TOKENS}, 4, {"tag": "dp2_ignored", "padded": "ignored"}),
    # Validated too: a validation microbatch without a valid label made the logged val_loss NaN.
    ("llama", {"pipeline_parallel": 2, **TOKENS}, 8, {"tag": "pp2_ignored", "padded": "ignored", "validate": True}),
]


def _reference_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k != "tag"}


@cache
def references() -> dict[tuple[str, str], Any]:
    wanted = {}
    for name, _, _, options in CASES:
        key = repr(sorted(_reference_options(options).items()))
        wanted[(name, key)] = (name, None, 8, {**_reference_options(options), "tag": key})
    return run_ranks(fit_cases, 1, list(wanted.values()), timeout=900)[0]


@cache
def results() -> list[dict[tuple[str, str], Any]]:
    return run_ranks(fit_cases, 2, CASES, timeout=1800)


@pytest.mark.parametrize(("name", "tag"), [(c[0], c[3]["tag"]) for c in CASES])
def test_logged_loss_is_one_process_loss_at_every_step(name: str, tag: str) -> None:
    options = next(c[3] for c in CASES if c[0] == name and c[3]["tag"] == tag)
    ref = references()[(name, repr(sorted(_reference_options(options).items())))]
    assert "error" not in ref, ref["error"]
    expected = [m["train_loss"] for m in ref["metrics"]]
    assert len(expected) >= 6 and all(abs(a - b) < 1e-6 for a, b in zip(expected, ref["losses"]))
    tolerance = 1e-12 if options.get("precision") == "64-true" else 1e-5
    strategy = next(c[1] for c in CASES if c[0] == name and c[3]["tag"] == tag)
    # Other values the step logs too, where a rank sees whole sequences (a context-parallel rank logs its part's).
    names = ["train_loss"] if "context_parallel" in strategy else sorted(ref["metrics"][0])
    for rank, out in enumerate(results()):
        run = out[(name, tag)]
        assert "error" not in run, run["error"]
        assert len(run["metrics"]) == len(expected)
        for key in names:
            for step, (got, want) in enumerate(zip([m[key] for m in run["metrics"]], [m[key] for m in ref["metrics"]])):
                assert abs(got - want) < tolerance, f"rank {rank} step {step}: logged {key} {got}, one process {want}"
        if options.get("validate"):
            assert abs(run["val_loss"] - ref["val_loss"]) < 1e-5, f"rank {rank}: val {run['val_loss']}, one process {ref['val_loss']}"


def test_the_loss_is_recognized_as_logged_and_other_values_are_not() -> None:
    loss = torch.tensor(2.5, requires_grad=True) * 1.0
    assert is_the_loss(loss, loss) and is_the_loss(loss.detach(), loss) and is_the_loss(2.5, loss)
    assert not is_the_loss(loss.detach().clone(), loss) and not is_the_loss(loss * 2, loss)
    assert not is_the_loss(1.0, loss) and not is_the_loss(True, loss)

    class Module(torch.nn.Module):
        def log(self, name: str, value: Any) -> None:
            raise AssertionError("captured calls do not reach the method")

    module = Module()
    with captured_logs(module) as outer:
        with captured_logs(module) as inner:
            module.log("a", 1.0)
        module.log("b", 2.0)
    assert [c.name for c in inner] == ["a"] and [c.name for c in outer] == ["b"]
    assert "log" not in module.__dict__  # the method is back
