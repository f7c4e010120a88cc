"""Activation checkpointing changes memory, never results: every mode reproduces training without it.
The activation measurement is checked against hand counts and the block formula."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_llmpar.activation_checkpointing.memory import block_activation_formula, held_activation_bytes
from lightning_llmpar.activation_checkpointing.policy import (
    ActivationCheckpointing,
    CheckpointPlan,
    _run,
    apply_activation_checkpointing,
    saved_activation_bytes,
    wrap_blocks,
)
from lightning_llmpar.models.gpt import GPT, GPTConfig
from tests.distributed import run_ranks
from tests.pipeline.test_pipeline import assert_pipeline_parity
from tests.test_parity import GLOBAL_BATCH, assert_parity, reference_for

MODES = [
    {"mode": "full"},
    {"mode": "every_k", "every": 2},
    {"mode": "selective", "save": "attention"},
    {"mode": "selective", "save": "attention_and_matmuls"},
    {"mode": "selective", "save": "attention_and_up_projections"},
    {"mode": "budget", "budget_mb": 1.5, "save": "attention_and_up_projections"},
]


def _grads_and_saved(plan: CheckpointPlan) -> tuple[torch.Tensor, int, int]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, block_size=64))
    wrapped = apply_activation_checkpointing(list(model.layers), plan)
    x = torch.randint(0, 256, (2, 64))
    saved = saved_activation_bytes(lambda: model(x).sum())
    F.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), wrapped, saved


@pytest.mark.parametrize("kwargs", MODES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_gradients_identical_to_no_checkpointing(kwargs: dict[str, Any]) -> None:
    reference, _, kept_without = _grads_and_saved(CheckpointPlan("none"))
    grads, wrapped, kept = _grads_and_saved(CheckpointPlan(**kwargs))
    assert wrapped == (2 if kwargs["mode"] == "every_k" else 4)
    assert kept_without > kept > 0
    torch.testing.assert_close(grads, reference, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "world", "checkpointing"),
    [
        # A budget between the extremes: blocks end up mixed (selective and none), decided alike on every rank.
        pytest.param({"tensor_parallel": 2, "zero_stage": 3}, 4,
                     {"mode": "budget", "budget_mb": 0.5, "save": "attention_and_up_projections"}, id="tp2-dp2-zero3-budget"),
        pytest.param({"zero_stage": 3}, 2, {"mode": "full"}, id="dp2-zero3-full"),
    ],
)
def test_checkpointing_under_parallel_layouts(kwargs: dict[str, Any], world: int, checkpointing: dict[str, Any]) -> None:
    from tests.workloads import fit

    dp = world // kwargs.get("tensor_parallel", 1)
    outs = run_ranks(fit, world, "gpt", kwargs, batch_size=GLOBAL_BATCH // dp, checkpointing=checkpointing)
    assert all(o["checkpointing_applied"] for o in outs)
    assert_parity(reference_for("gpt"), outs, dp)
    if checkpointing["mode"] == "budget":
        kept = [{k: v for k, v in o["logged"].items() if k.startswith("activation_mb/")} for o in outs]
        assert all(k == kept[0] for k in kept), kept
        per_block = [v for k, v in kept[0].items() if k != "activation_mb/total"]
        assert len(set(per_block)) > 1 and kept[0]["activation_mb/total"] <= checkpointing["budget_mb"], kept[0]


@pytest.mark.parametrize(("kwargs", "world"), [pytest.param(None, 1, id="plain-lightning"),
                                              pytest.param({"tensor_parallel": 2}, 2, id="tp2")])
def test_selective_checkpointing_of_a_transformers_llama_with_its_cache_on(kwargs: dict[str, Any] | None,
                                                                          world: int) -> None:
    """transformers' Llama keeps a key/value cache in training forwards (``use_cache=True``, its config's default):
    recomputed, a block added to it again and selective recomputation failed in backward. It trains as without
    checkpointing, under the callback alone and under the strategy."""
    from tests.workloads import fit

    checkpointing = {"mode": "selective", "save": "attention_and_up_projections"}
    outs = run_ranks(fit, world, "llama", kwargs, batch_size=GLOBAL_BATCH, checkpointing=checkpointing)
    assert all(o["checkpointing_applied"] for o in outs)
    assert_parity(reference_for("llama"), outs, 1)


def test_measuring_a_transformers_llama_leaves_its_cache_alone() -> None:
    """``measure=True`` runs each block once more at its first forward; that run appended to transformers' key/value
    cache too, and the real one then attended over both: with ``mode='none'`` the first step's gradients were off
    by 3e-2 and the loss by 8e-2 after 6 steps, silently. The measuring run now goes without the cache."""
    from tests.workloads import fit

    outs = run_ranks(fit, 1, "llama", None, batch_size=GLOBAL_BATCH, checkpointing={"mode": "none", "measure": True})
    assert_parity(reference_for("llama"), outs, 1)


@pytest.mark.parametrize(("reentrant", "mode", "forwards"), [
    pytest.param(True, "full", 2, id="reentrant-full"),  # was 3: recomputed by transformers' checkpoint and by ours
    pytest.param(False, "every_k", 1, id="every_k"),  # was 2: block 1, which every_k keeps, recomputed all the same
])
def test_transformers_checkpointing_gives_way_to_the_plan(reentrant: bool, mode: str, forwards: int) -> None:
    """A user who called ``activation_checkpointing_enable()`` and added the callback: transformers' checkpoint
    around each layer's call and ours inside it. Reentrant, every block was recomputed twice in backward; either way
    every block was recomputed in full, whatever the plan said. The plan's recomputation is now the one that runs,
    with a warning, and gradients are those without any checkpointing."""
    import transformers

    from tests.zoo import make_config

    def grads_and_forwards(checkpointing: bool, callback: bool) -> tuple[torch.Tensor, int]:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(make_config("llama")).train()
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": reentrant})
        if callback:
            ActivationCheckpointing(mode=mode).apply(model)  # type: ignore[arg-type]
        calls = []
        model.model.layers[1].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        ids = torch.randint(0, model.config.vocab_size, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), len(calls)

    reference, once = grads_and_forwards(False, False)
    assert once == 1 and grads_and_forwards(True, False)[1] == 2  # the count sees transformers' recomputation
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads, counted = grads_and_forwards(True, True)
    assert counted == forwards
    assert any("gradient_checkpointing_enable()) was on as well" in str(w.message) for w in caught), caught
    torch.testing.assert_close(grads, reference, atol=0, rtol=0)


def test_checkpointing_under_pipeline() -> None:
    from tests.workloads import fit

    outs = run_ranks(fit, 2, "gpt", {"pipeline_parallel": 2}, batch_size=GLOBAL_BATCH, checkpointing={"mode": "every_k"})
    assert all(o["checkpointing_applied"] for o in outs)
    assert_pipeline_parity(reference_for("gpt"), outs)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=r"mode='some' is not one of"):
        ActivationCheckpointing(mode="some")  # type: ignore[arg-type]
    for every in (0, 1.5, True):  # 1.5 ran, checkpointing blocks 0, 3, 6, ... (index % 1.5 == 0)
        with pytest.raises(ValueError, match=rf"every={every!r} must be a whole number of blocks, at least 1"):
            ActivationCheckpointing(mode="every_k", every=every)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"mode='budget' needs budget_mb > 0 \(got None\)"):
        ActivationCheckpointing(mode="budget")
    with pytest.raises(ValueError, match=r"budget_mb=10 is only read by mode='budget'"):
        ActivationCheckpointing(mode="full", budget_mb=10)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sin().exp().sum(-1)


@pytest.mark.parametrize(
    ("mode", "elements"),
    [
        # mm keeps x (its weight is a parameter, not an activation); sin keeps h = x @ W.T; exp keeps
        # its own result; sin's result and the sum's output are not kept (the output is the caller's).
        ("none", 8 + 16 + 16),
        ("full", 8),  # only the checkpointed region's input
        ("selective", 8 + 16),  # its input and the cached matmul output; sin/exp are recomputed
    ],
)
def test_measurement_matches_hand_count(mode: str, elements: int) -> None:
    batch = 3
    x, tiny = torch.randn(batch, 8, requires_grad=True), _Tiny()
    held = held_activation_bytes(lambda t: _run(tiny.forward, mode, "attention_and_matmuls", t), x)  # type: ignore[arg-type]
    assert held == 4 * batch * elements


def _block_and_input(n_embd: int = 64, seq: int = 32, batch: int = 2) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=n_embd, block_size=seq))
    x = torch.randn(batch, seq, n_embd, requires_grad=True)
    return model.layers[0], (x, model.rope_cos, model.rope_sin)


def test_gpt_block_bytes_match_the_formula() -> None:
    block, args = _block_and_input()
    batch, seq, hidden = args[0].shape
    formula = block_activation_formula(seq, batch, hidden, heads=4, mlp_hidden=block.mlp.gate_proj.out_features)
    measured = held_activation_bytes(block.forward, *args)
    assert abs(measured / formula["total"] - 1) < 0.10, (measured, formula)
    # Full recompute keeps exactly the block input.
    assert held_activation_bytes(lambda *a: _run(block.forward, "full", "attention", *a), *args) == 4 * batch * seq * hidden


def _budgeted_gpt(budget_mb: float) -> tuple[GPT, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, block_size=64))
    plan = CheckpointPlan("budget", save="attention_and_up_projections", budget_mb=budget_mb)
    return model, wrap_blocks(list(model.layers), plan, groups=[])


def _stack_bytes(model: GPT, idx: torch.Tensor) -> int:
    """Bytes the block stack keeps, measured around the whole stack (independently of the planner)."""
    cos, sin = model.rope_cos[: idx.shape[1]], model.rope_sin[: idx.shape[1]]

    def stack(h: torch.Tensor) -> torch.Tensor:
        for layer in model.layers:
            h = layer(h, cos, sin)
        return h

    return held_activation_bytes(stack, model.tok_emb(idx))


def test_budget_mode_fits_and_recomputes_less_as_it_grows() -> None:
    idx = torch.randint(0, 256, (2, 64))
    model, planner = _budgeted_gpt(1e6)
    model(idx)  # the first forward measures every block under none / selective / full
    none = sum(m["none"] for m in planner.measured)
    full = sum(m["full"] for m in planner.measured)
    assert planner.modes == ["none"] * 4
    recompute = []
    for share in (0.1, 0.4, 0.8):
        budget = (full + share * (none - full)) / 2**20
        model, planner = _budgeted_gpt(budget)
        model(idx)
        kept = _stack_bytes(model, idx)
        assert kept <= budget * 2**20
        assert kept == sum(r["bytes"] for r in planner.report)
        recompute.append(sum({"none": 0, "selective": 1, "full": 2}[m] for m in planner.modes))
    assert recompute[0] > recompute[1] > recompute[2] > 0, recompute
    model, _ = _budgeted_gpt(full / 2**20 / 2)
    with pytest.raises(ValueError, match=r"budget_mb=0.0\d+ cannot be met: even full recompute of all 4 blocks keeps"):
        model(idx)


def test_recomputation_cut_short_inside_a_split_module() -> None:
    # Recomputation stops once backward has what it needs, here inside Jamba's experts (the block's last module):
    # modules that run on local tensors of their DTensor parameters (split experts, Mamba mixers) must swap them
    # back even so, or the next forward finds plain tensors.
    from tests.zoo import assert_exact, fit_cases

    cases = [(name, {"tensor_parallel": 2}, 8, {"checkpointing": "full"}) for name in ("jamba", "bamba")]
    refs = run_ranks(fit_cases, 1, [(name, None, 8, {"checkpointing": "full"}) for name, *_ in cases])[0]
    outs = run_ranks(fit_cases, 2, cases)
    for name, kwargs, _, _ in cases:
        assert_exact(refs[(name, "None")], [o[(name, repr(kwargs))] for o in outs])
