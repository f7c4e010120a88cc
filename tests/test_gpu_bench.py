"""`python -m benchmarks.gpu`: its CPU dry run (the same sections on a tiny model) and, on a GPU, the real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = {"exactness_fp32", "bf16_1b", "bf16_1b_compile", "bf16_d4096_compile", "fp8_tensorwise_d4096_compile",
            "fp8_rowwise_d4096_compile", "bf16_1b_ac_full", "bf16_1b_ac_every_k", "bf16_1b_ac_selective",
            "bf16_1b_ac_selective_matmuls", "bf16_1b_ac_budget", "bf16_1b_previous_grads_held", "ring_attention_cp"}


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu", *args], check=False, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_dry_run_exercises_every_section_on_cpu(tmp_path: Path) -> None:
    real = ROOT / "benchmarks/results/gpu.json"
    before = real.stat().st_mtime_ns if real.exists() else None
    out = tmp_path / "gpu.json"
    done = _run("--dry-run", "--out", str(out), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and set(report["sections"]) == SECTIONS and set(report["seconds"]) == SECTIONS
    assert report["summary"]["failed_sections"] == [], report["summary"]["failed_sections"]
    exact = report["sections"]["exactness_fp32"]
    assert exact["passed"] and exact["max_loss_diff"] <= 1e-5 and len(exact["losses_ours"]) == exact["steps"]
    fp8 = report["sections"]["fp8_tensorwise_d4096_compile"]
    assert fp8["converted_fp8_linears"] == 7 and report["sections"]["bf16_d4096_compile"]["converted_fp8_linears"] == 0
    ring = report["sections"]["ring_attention_cp"]
    assert [r["cp"] for r in ring["rows"]] == [1, 2, 4, 8] and all(r["ring_over_predicted"] > 0 for r in ring["rows"])
    for name in SECTIONS - {"exactness_fp32", "ring_attention_cp"}:
        run = report["sections"][name]
        assert run["tokens_per_s"] > 0 and run["steps"] == 2, name
        modelled = not name.endswith(("selective_matmuls", "budget"))
        assert (run["planner"] is not None) == modelled, name
    assert report["sections"]["bf16_1b_ac_budget"]["checkpointed_blocks"]  # the budget chose per block
    held, released = report["sections"]["bf16_1b_previous_grads_held"], report["sections"]["bf16_1b"]
    assert held["holds_previous_grads"] and not released["holds_previous_grads"]
    assert held["planner"]["reserved_gib"] > released["planner"]["reserved_gib"]  # last step's gradients counted
    assert (real.stat().st_mtime_ns if real.exists() else None) == before  # a dry run never writes the real file
    # --repredict puts the current planner beside stored measurements, which it leaves as they are.
    stored = json.loads(out.read_text())
    for run in stored["sections"].values():
        if run.get("planner"):
            run["planner"]["reserved_gib"] = -1.0
    out.write_text(json.dumps(stored))
    again = _run("--repredict", str(out), timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    redone = json.loads(out.read_text())
    assert redone["sections"]["bf16_1b"]["planner"] == report["sections"]["bf16_1b"]["planner"]
    assert redone["sections"]["bf16_1b"]["tokens_per_s"] == report["sections"]["bf16_1b"]["tokens_per_s"]
    assert redone["summary"]["previous_grads_release_predicted_gib"] > 0
    assert redone["sections"]["ring_attention_cp"]["rows"][3]["planner"] == ring["rows"][3]["planner"]
    refused = _run("--dry-run", "--out", str(real), timeout=120)
    assert refused.returncode != 0 and "never writes" in refused.stderr


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_the_emulated_ring_rank_computes_attention_over_the_keys_it_is_given(cp: int) -> None:
    """The ring section's rank (the last: its own causal block, then the first half of each received block) is
    attention over its keys followed by cp - 1 copies of their first half, all of those visible: output and the
    three gradients against autograd through SDPA with that mask (the copies' key/value gradients summed back)."""
    from benchmarks.gpu.ring import _backward, _forward

    g = torch.Generator().manual_seed(cp)
    q, k, v, dout = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64).float() for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    keys = torch.cat([k] + [k[:, :, :4]] * (cp - 1), dim=2)
    values = torch.cat([v] + [v[:, :, :4]] * (cp - 1), dim=2)
    mask = torch.cat([torch.ones(8, 8).tril().bool(), torch.ones(8, 4 * (cp - 1), dtype=torch.bool)], dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    want.backward(dout)
    with torch.no_grad():
        out, lse = _forward(q, k, v, cp, kernels_only=False)
        grads = _backward(dout, q, k, v, out, lse, cp, kernels_only=False)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_benchmark_runs_on_one_gpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    done = _run("--out", str(out), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["sections"]["exactness_fp32"]["passed"]
    assert report["summary"]["bf16_1b_mfu"] and report["summary"]["planner_vs_measured"]
    # Released before the step, last step's gradients (3.9 GiB for the 1B model) leave the forward's peak. The peak
    # then moves to the start of backward, where the logits' fp32 gradient appears: one H100 measured 2.9 GiB less
    # allocated at the peak in two runs, and 1.8 and 1.3 GiB less reserved (the allocator's segments vary).
    assert report["summary"]["previous_grads_release_saves_allocated_gib"] > 2.0, report["summary"]
    assert report["summary"]["previous_grads_release_saves_gib"] > 0, report["summary"]
