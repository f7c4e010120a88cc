"""Activation-checkpointing benchmark: bytes kept for backward (per block and total) and step time of
none / full / every-k / selective (each policy) / budget, side by side in one run, for the example GPT.

Run from the repository root:  python -m benchmarks.activation_bench
Writes benchmarks/results/activation.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_llmpar.activation_checkpointing.memory import block_activation_formula, korthikanti_bytes
from lightning_llmpar.activation_checkpointing.policy import ActivationCheckpointing
from lightning_llmpar.models.gpt import GPT, GPTConfig

OUT = Path(__file__).parent / "results" / "activation.json"
MODEL = {"vocab_size": 256, "block_size": 1024, "n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 256}
BATCH = 4
MB = 2**20


def make(kwargs: dict[str, Any]) -> tuple[GPT, ActivationCheckpointing, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    callback = ActivationCheckpointing(measure=True, **kwargs)
    callback.apply(model)
    return model, callback, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model: GPT, optimizer: torch.optim.Optimizer, idx: torch.Tensor) -> float:
    start = time.perf_counter()
    logits = model(idx[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="timed steps per case (after 2 warm-up steps)")
    parser.add_argument("--threads", type=int, default=1)
    cli = parser.parse_args()
    torch.set_num_threads(cli.threads)
    cfg = GPTConfig(**MODEL)
    seq = cfg.block_size
    idx = torch.randint(0, cfg.vocab_size, (BATCH, seq + 1), generator=torch.Generator().manual_seed(0))

    cases: dict[str, dict[str, Any]] = {
        "none": {"mode": "none"},
        "full": {"mode": "full"},
        "every_2": {"mode": "every_k", "every": 2},
        "selective_attention": {"mode": "selective", "save": "attention"},
        "selective_attention_and_matmuls": {"mode": "selective", "save": "attention_and_matmuls"},
        "selective_attention_and_up_projections": {"mode": "selective", "save": "attention_and_up_projections"},
    }
    built = {name: make(kw) for name, kw in cases.items()}
    # The first step measures the blocks (the budget cases need the extremes to pick their budgets).
    for model, _, opt in built.values():
        step(model, opt, idx)
    none_total = sum(r["bytes"] for r in built["none"][1].report)  # type: ignore[union-attr]
    full_total = sum(r["bytes"] for r in built["full"][1].report)  # type: ignore[union-attr]
    for share in (0.25, 0.5):
        budget = (full_total + share * (none_total - full_total)) / MB
        cases[f"budget_{int(share * 100)}pct"] = {"mode": "budget", "budget_mb": round(budget, 1),
                                                   "save": "attention_and_up_projections"}
        built[f"budget_{int(share * 100)}pct"] = make(cases[f"budget_{int(share * 100)}pct"])
        model, _, opt = built[f"budget_{int(share * 100)}pct"]
        step(model, opt, idx)

    # Round-robin over the cases so a change in machine load touches them all alike.
    times: dict[str, list[float]] = {name: [] for name in cases}
    for repeat in range(cli.steps + 1):
        for name, (model, _, opt) in built.items():
            elapsed = step(model, opt, idx)
            if repeat > 0:  # one more warm-up step each (the first, above, measured)
                times[name].append(elapsed)

    formula = block_activation_formula(seq, BATCH, cfg.n_embd, cfg.n_head, cfg.mlp_hidden or 0)
    base_time = statistics.median(times["none"])
    rows = []
    for name, (_, callback, _) in built.items():
        report = callback.report or []
        total = sum(r["bytes"] for r in report)
        median = statistics.median(times[name])
        row = {
            "case": name, **cases[name],
            "block_modes": [r["mode"] for r in report],
            "bytes_per_block": [r["bytes"] for r in report],
            "total_mb": round(total / MB, 2),
            "bytes_saved_vs_none": round(1 - total / none_total, 4),
            "step_s_median": round(median, 4),
            "step_s_min": round(min(times[name]), 4),
            "step_s_all": [round(t, 4) for t in times[name]],
            "extra_step_time_vs_none": round(median / base_time - 1, 4),
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "step_s_all"}), flush=True)
    none_block = built["none"][1].report[0]["bytes"]  # type: ignore[index]
    result = {
        "machine": platform.machine(), "cpus": os.cpu_count(), "threads": cli.threads, "torch": torch.__version__,
        "model": MODEL, "mlp_hidden": cfg.mlp_hidden, "batch": BATCH, "seq": seq, "dtype": "float32",
        "timed_steps": cli.steps,
        "formula_block_bytes": formula,
        "measured_none_block_bytes": none_block,
        "measured_over_formula": round(none_block / formula["total"], 4),
        "korthikanti_16bit_block_bytes": korthikanti_bytes(seq, BATCH, cfg.n_embd, cfg.n_head),
        "rows": rows,
        "note": "bytes = storages created in a block's forward that are still alive after it (held by the autograd"
                " graph or a checkpoint cache), inputs included, outputs excluded, measured at the first step with"
                " the real input. Step = forward + backward + AdamW, median of the timed steps, cases run"
                " round-robin.",
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(f"-> {OUT}")


if __name__ == "__main__":
    main()
