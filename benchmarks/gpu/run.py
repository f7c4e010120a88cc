"""Sections of the GPU benchmark, each timed and guarded, under one time budget; the JSON written after each."""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["main", "repredict", "sections"]

OUT = Path(__file__).resolve().parents[1] / "results" / "gpu.json"
# ~1.06B parameters (20 blocks of width 2048, SwiGLU 5472, 32k vocabulary untied); FP8 at width 4096 with 8 blocks,
# so the bf16 output head (kept out of FP8, as torchtitan does) is a share of the FLOPs closer to a real model's.
MODEL_1B = {"vocab_size": 32768, "block_size": 2048, "n_layer": 20, "n_head": 16, "n_kv_head": 8, "n_embd": 2048}
MODEL_D4096 = {"vocab_size": 32768, "block_size": 2048, "n_layer": 8, "n_head": 32, "n_kv_head": 8, "n_embd": 4096}
MODEL_EXACT = {"vocab_size": 512, "block_size": 128, "n_layer": 4, "n_head": 8, "n_kv_head": 4, "n_embd": 256}
TINY = {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64}
TINY_WIDE = {"vocab_size": 256, "block_size": 32, "n_layer": 1, "n_head": 4, "n_kv_head": 2, "n_embd": 128}
AC_MODES = ("full", "every_k", "selective", "selective_matmuls", "budget")


def sections(dry_run: bool) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """(name, run) in the order they run: the headline figures first, so a short budget still gets them."""
    from benchmarks.gpu.exactness import exactness  # Lightning's import only once the arguments are accepted
    from benchmarks.gpu.ring import ring_attention
    from benchmarks.gpu.train import predict, train

    acc = "cpu" if dry_run else "cuda"
    big, wide, exact = (TINY, TINY_WIDE, TINY) if dry_run else (MODEL_1B, MODEL_D4096, MODEL_EXACT)
    steps, batch = (2, 2) if dry_run else (30, 8)
    # Inductor on a CPU compiles for minutes; the dry run checks the code path with compile off.
    compiled = not dry_run

    def run(model: dict[str, int], **kw: Any) -> Callable[[], dict[str, Any]]:
        def go() -> dict[str, Any]:
            measured = train(model, accelerator=acc, steps=steps, batch=batch, **kw)
            device = torch.cuda.get_device_name(0) if acc == "cuda" else "cpu"
            measured["planner"] = predict(model, batch, device, kw.get("checkpointing", "none"),
                                          kw.get("compile", False), kw.get("float8"),
                                          kw.get("holds_previous_grads", False))
            return measured
        return go

    out = [
        ("exactness_fp32", lambda: exactness(acc, exact, steps=2 if dry_run else 4)),
        ("bf16_1b", run(big)),
        ("bf16_1b_compile", run(big, compile=compiled)),
        ("bf16_d4096_compile", run(wide, compile=compiled)),
        ("fp8_tensorwise_d4096_compile", run(wide, compile=compiled, float8="tensorwise")),
        ("fp8_rowwise_d4096_compile", run(wide, compile=compiled, float8="rowwise")),
    ]
    # One context-parallel rank's attention at torchtitan's 8B shapes (32 heads of 128, 32768 tokens a rank).
    ring = {"heads": 4, "head_dim": 32, "tokens": 256, "repeats": 1} if dry_run else {}
    out.append(("ring_attention_cp", lambda: ring_attention(acc, **ring)))
    budget_mb = 4.0 if dry_run else 6144.0  # about half of what the 1B model's 20 blocks keep without checkpointing
    for mode in AC_MODES:
        out.append((f"bf16_1b_ac_{mode}", run(big, checkpointing=mode,
                                              budget_mb=budget_mb if mode == "budget" else None)))
    # bf16_1b again with last step's gradients kept through the step (a hook before zero_grad): what releasing
    # them saves at the forward's peak.
    out.append(("bf16_1b_previous_grads_held", run(big, holds_previous_grads=True)))
    return out


def _summary(results: dict[str, Any]) -> dict[str, Any]:
    def get(name: str, key: str) -> Any:
        r = results.get(name, {})
        return r.get(key) if isinstance(r, dict) else None

    summary: dict[str, Any] = {"bf16_1b_mfu": get("bf16_1b_compile", "mfu_bf16_peak") or get("bf16_1b", "mfu_bf16_peak")}
    bf16, fp8 = get("bf16_d4096_compile", "tokens_per_s"), get("fp8_tensorwise_d4096_compile", "tokens_per_s")
    summary["fp8_over_bf16_tokens_per_s_d4096"] = fp8 / bf16 if bf16 and fp8 else None
    summary["exactness_passed"] = get("exactness_fp32", "passed")
    # What releasing last step's gradients saves: in reserved bytes (the headline), in allocated bytes, and as the
    # planner predicts it (reserved).
    for key, field in (("", "peak_reserved_gib"), ("_allocated", "peak_allocated_gib")):
        held, released = get("bf16_1b_previous_grads_held", field), get("bf16_1b", field)
        summary[f"previous_grads_release_saves{key}_gib"] = held - released if held and released else None
    held, released = get("bf16_1b_previous_grads_held", "planner"), get("bf16_1b", "planner")
    summary["previous_grads_release_predicted_gib"] = (held["reserved_gib"] - released["reserved_gib"]
                                                       if held and released else None)
    pairs = []
    for name, r in results.items():
        if isinstance(r, dict) and r.get("planner") and r.get("tokens_per_s"):
            p = r["planner"]
            pairs.append({"run": name, "tokens_per_s": r["tokens_per_s"], "predicted": p["tokens_per_s"],
                          "tokens_error": p["tokens_per_s"] / r["tokens_per_s"] - 1,
                          "reserved_gib": r.get("peak_reserved_gib"), "predicted_gib": p["reserved_gib"],
                          "memory_error": p["reserved_gib"] / r["peak_reserved_gib"] - 1
                          if r.get("peak_reserved_gib") else None})
    summary["planner_vs_measured"] = pairs
    ring = results.get("ring_attention_cp")
    if isinstance(ring, dict) and "rows" in ring:
        summary["ring_attention_measured_over_predicted"] = {r["cp"]: r["ring_over_predicted"] for r in ring["rows"]}
    summary["failed_sections"] = [n for n, r in results.items() if isinstance(r, dict) and "error" in r]
    return summary


def repredict(path: Path) -> dict[str, Any]:
    """Rewrite each run's ``planner`` entry in a written report with the current planner, for the device the report
    names, and its summary; the measurements stay as they are."""
    from benchmarks.gpu.ring import with_prediction
    from benchmarks.gpu.train import cluster_kind, predict

    report = json.loads(path.read_text())
    device = "cpu" if report["dry_run"] else report["device"]
    for run in report["sections"].values():
        if isinstance(run, dict) and "planner" in run:
            run["planner"] = predict(run["model"], run["batch"], device, run["checkpointing"],
                                     run["compile"], run["float8"], run["holds_previous_grads"])
        if isinstance(run, dict) and "rows" in run:  # the ring attention section
            run["rows"] = [with_prediction(r, run["heads"], run["head_dim"], run["tokens_per_rank"], cluster_kind(device))
                           for r in run["rows"]]
    report["summary"] = _summary(report["sections"])
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps(report["summary"], indent=1, default=str))
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny models, compile off: checks the code path")
    parser.add_argument("--out", type=Path, help=f"JSON to write (default {OUT}; a temp file with --dry-run)")
    parser.add_argument("--budget-s", type=float, default=None, help="time budget (default 450 s, dry run 120 s)")
    parser.add_argument("--only", nargs="+", help="run only these sections")
    parser.add_argument("--repredict", type=Path, metavar="JSON",
                        help="no run: put the current planner's predictions beside the measurements in JSON")
    args = parser.parse_args(argv)
    if args.repredict:
        return repredict(args.repredict)
    if args.dry_run:
        out = args.out or Path(tempfile.mkdtemp(prefix="llmpar-gpu-")) / "gpu.json"
        if out.resolve() == OUT.resolve():
            raise SystemExit(f"--dry-run never writes {OUT}: give another --out.")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("python -m benchmarks.gpu needs a CUDA GPU; use --dry-run to check it on a CPU.")
        out = args.out or OUT
    budget = args.budget_s or (120.0 if args.dry_run else 450.0)
    start = time.perf_counter()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if not args.dry_run else "cpu (dry run)",
        "torch": torch.__version__, "host": platform.node(), "dry_run": args.dry_run, "budget_s": budget,
        "targets": {"bf16_1b_mfu": ">= 0.50", "fp8_over_bf16_tokens_per_s_d4096": ">= 1.3",
                    "exactness": "losses and grads within 1e-5 (fp32, SGD)"},
        "sections": {}, "seconds": {},
    }
    for name, fn in sections(args.dry_run):
        if args.only and name not in args.only:
            continue
        if time.perf_counter() - start > budget:
            report["sections"][name] = {"skipped": f"time budget of {budget:.0f} s spent"}
            continue
        t0 = time.perf_counter()
        try:
            report["sections"][name] = fn()
        except Exception as err:  # noqa: BLE001 -- one section's failure must not lose the others' figures
            report["sections"][name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        report["seconds"][name] = round(time.perf_counter() - t0, 2)
        report["summary"] = _summary(report["sections"])
        report["total_s"] = round(time.perf_counter() - start, 2)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"[benchmarks.gpu] {name}: {report['seconds'][name]} s"
              + (f" ERROR {report['sections'][name]['error']}" if "error" in report["sections"][name] else ""),
              flush=True)
    report["summary"] = _summary(report["sections"])
    report["total_s"] = round(time.perf_counter() - start, 2)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps(report["summary"], indent=1, default=str))
    print(f"wrote {out}")
    return report
