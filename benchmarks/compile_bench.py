"""compile=True measured: the example GPT (6 blocks, d=384, 128 tokens, 4 samples per rank) on two gloo ranks, eager
vs every block compiled (inductor on CPU), at dp2 ZeRO-0 and ZeRO-3, at tp2 with and without sequence
parallelism and at cp2 (ring attention, eager between the compiled parts), in interleaved rounds inside one launch.
The compile time falls in the warm-up steps; the median seconds per measured step are compared.

``--profile`` adds where rank 0's time goes per step (torch.profiler self CPU time by kind of op) and the ceiling
of any speedup that fusing can give: the eager step with every op other than GEMMs, attention, collectives and the
optimizer kernel removed at no cost. It also gives the rate the step's GEMMs run at (the model's GEMM FLOPs per
rank, counted from its shapes, over their profiled time) beside what one core reaches on one large fp32 GEMM:
compiled code calls the same GEMM kernels, so where they already run near that peak only the rest can shrink.

Run from the repository root:  python -m benchmarks.compile_bench [--rounds 3] [--steps 12] [--warmup 4] [--profile]
Writes benchmarks/results/compile.json (``--only llmpar_cp2,...``: those eager layouts and their compiled twins,
written to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from benchmarks.vs_lightning import BATCH, MODEL, _profiles, _rounds
from lightning_llmpar.launch import run_ranks

OUT = Path(__file__).parent / "results" / "compile.json"
EAGER = ("llmpar_zero0", "llmpar_zero3", "llmpar_tp2", "llmpar_tp2_no_sp", "llmpar_cp2")
PAIRS = [(f"{eager}_compile", eager) for eager in EAGER]
# What fusing cannot shorten: the GEMMs and attention kernels (called as they are from compiled code on CPU),
# collectives, FSDP2's communication ranges and the optimizer.
KEPT = {"gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"), "attention": ("scaled_dot_product",),
        "communication": ("c10d", "gloo", "wait_tensor", "FSDP::"), "optimizer": ("Optimizer.", "_fused_adam")}


def _kind(op: str) -> str:
    for kind, marks in KEPT.items():
        if any(m in op for m in marks):
            return kind
    return "other_aten" if op.startswith("aten::") else "other"


def _time_by_kind(ops: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for op in ops:
        kind = _kind(op["op"])
        out[kind] = out.get(kind, 0.0) + op["self_ms_per_step"]
    return {k: round(v, 1) for k, v in sorted(out.items())}


def _gemm_gflop_per_rank_step(name: str) -> float:
    """The example GPT's GEMM FLOPs per rank and training step (forward, and backward at twice the forward): the
    blocks' projections (q, k, v, o and the gated MLP of width 8d/3: 12 d^2 multiply-adds per token) and the head;
    attention's own products run inside the attention kernel, counted apart."""
    d, layers, vocab, tokens = MODEL["n_embd"], MODEL["n_layer"], MODEL["vocab_size"], BATCH * MODEL["block_size"]
    split = 2 if "tp2" in name else 1  # tensor parallelism: each rank computes half the features of every GEMM
    return 3 * 2 * tokens * (layers * 12 * d * d + d * vocab) / split / 1e9


def _one_core_gemm_peak() -> float:
    """GFLOP/s of one thread on a large fp32 GEMM (the best of four runs)."""
    import time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(1536, 1536), torch.randn(1536, 1536)
    best = float("inf")
    for _ in range(4):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(threads)
    return 2 * 1536**3 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--profile", action="store_true", help="also record where the time goes and the ceiling")
    parser.add_argument("--only", default="", help="comma-separated eager layouts to run (default: all)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    pairs = [p for p in PAIRS if not args.only or p[1] in args.only.split(",")]
    names = sorted({n for pair in pairs for n in pair})
    runs = run_ranks(_rounds, 2, names, args.rounds, args.steps, args.warmup, timeout=3000)[0]
    seconds = {n: statistics.median(v) if isinstance(v, list) and v else v for n, v in runs.items()}
    speedups = {compiled: seconds[eager] / seconds[compiled] for compiled, eager in pairs
                if isinstance(seconds[compiled], float) and isinstance(seconds[eager], float)}
    result = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "model": MODEL, "batch_per_rank": BATCH, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "seconds_per_step_median": seconds, "rounds_seconds": runs, "speedup_compiled_over_eager": speedups,
        "target_1.2x_on_cpu": {k: v >= 1.2 for k, v in speedups.items()},
    }
    if args.profile:
        profiles = run_ranks(_profiles, 2, names, args.steps, args.warmup, None, timeout=3000)[0]
        kinds = {n: _time_by_kind(v) if isinstance(v, list) else v for n, v in profiles.items()}
        result["profile_rank0_ms_per_step_by_kind"] = kinds
        # Generous: profiled ms are inflated by the profiler's per-op cost, which eager (more, smaller ops) pays more.
        result["ceiling_if_fusing_removed_every_other_op"] = {
            eager: seconds[eager] / (seconds[eager] - (kinds[eager].get("other_aten", 0.0)) / 1e3)
            for _, eager in pairs if isinstance(kinds.get(eager), dict) and isinstance(seconds[eager], float)
        }
        peak = _one_core_gemm_peak()
        result["gemm_rate_gflop_per_s"] = {
            "one_core_peak_on_a_1536_cubed_gemm": round(peak, 1),
            **{n: round(_gemm_gflop_per_rank_step(n) / (k["gemm"] / 1e3), 1)
               for n, k in kinds.items() if isinstance(k, dict) and k.get("gemm")},
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result.get(k) for k in ("seconds_per_step_median", "speedup_compiled_over_eager",
                                                  "profile_rank0_ms_per_step_by_kind",
                                                  "ceiling_if_fusing_removed_every_other_op",
                                                  "gemm_rate_gflop_per_s")}, indent=1))


if __name__ == "__main__":
    main()
