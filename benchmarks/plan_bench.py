"""The planner's memory model against measured per-rank peaks, on this machine's CPU processes (gloo).

Each layout trains the example GPT for 3 steps; every rank samples its host bytes in use after each op
(``lightning_llmpar.planner.measure``); the largest rank's peak is compared with the planner's prediction for the
fullest rank. The model here (6 blocks, d=384, 128-token sequences) is not the one the memory model's terms were
checked on while it was written (4 blocks, d=256, 256 tokens).

``--part time`` checks the step-time model the same way: this machine is described as a cluster from
micro-benchmarks (one thread's GEMM rate and memory bandwidth, gloo's all-reduce bandwidth and latency between
two processes, the per-layer cost of a tiny model's step), then 2-process layouts are timed (median step after a
warm-up) and compared with the predictions, by ratio and by rank order.

Run from the repository root:  python -m benchmarks.plan_bench [--part memory|time|all]
Writes benchmarks/results/plan.json (each part its own section).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from lightning_llmpar.launch import run_ranks
from lightning_llmpar.planner.candidate import Candidate
from lightning_llmpar.planner.cluster import PRECISIONS, Cluster
from lightning_llmpar.planner.measure import measure_layout
from lightning_llmpar.planner.memory import predict_memory, predict_rank_memory
from lightning_llmpar.planner.spec import model_spec
from lightning_llmpar.planner.speed import predict_step_time

OUT = Path(__file__).parent / "results" / "plan.json"
MODEL = {"vocab_size": 256, "n_layer": 6, "n_head": 6, "n_kv_head": 2, "n_embd": 384}
SEQ = 128
MiB = 2**20

LAYOUTS = [
    Candidate(micro_batch=8),
    Candidate(micro_batch=8, checkpointing="full"),
    Candidate(dp=2, dp_replicate=2, micro_batch=8),
    Candidate(dp=2, zero=2, micro_batch=8, checkpointing="selective"),
    Candidate(dp=2, zero=3, micro_batch=8, checkpointing="full"),
    Candidate(dp=2, zero=3, micro_batch=4, microbatches=2),
    Candidate(tp=2, micro_batch=8),
    Candidate(pp=2, micro_batch=2, microbatches=4, schedule="Interleaved1F1B", virtual=2),
    Candidate(dp=2, tp=2, zero=3, micro_batch=8),
    Candidate(tp=2, pp=2, micro_batch=2, microbatches=4, schedule="1F1B", checkpointing="full"),
    Candidate(dp=2, tp=2, pp=2, zero=2, micro_batch=2, microbatches=4, schedule="Interleaved1F1B", virtual=2),
]


TIMED = [
    Candidate(micro_batch=8),
    Candidate(dp=2, dp_replicate=2, micro_batch=8),
    Candidate(dp=2, zero=2, micro_batch=8),
    Candidate(dp=2, zero=3, micro_batch=8),
    Candidate(dp=2, zero=3, micro_batch=8, checkpointing="full"),
    Candidate(dp=2, zero=3, micro_batch=2, microbatches=4),
    Candidate(tp=2, micro_batch=8),
    Candidate(tp=2, micro_batch=8, sequence_parallel=False),
    Candidate(pp=2, micro_batch=2, microbatches=4, schedule="1F1B"),
    Candidate(pp=2, micro_batch=2, microbatches=4, schedule="Interleaved1F1B", virtual=2),
]


def _measure_all(layouts: list[Candidate], steps: int, what: str = "memory") -> list[Any]:
    return [measure_layout(c, MODEL, SEQ, steps, what) for c in layouts]


def _rate(fn: Any, repeat: int = 20, trials: int = 5) -> float:
    """Seconds per call: the best of ``trials`` means (the machine is shared; the best is the machine's own rate)."""
    fn()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def _links() -> tuple[float, float]:
    """gloo between two processes: all-reduce GB/s of a 16 MiB tensor (ring formula) and one small op's latency."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    big, small = torch.ones(4 * MiB), torch.ones(1)
    t_big = _rate(lambda: dist.all_reduce(big), 10)
    t_small = _rate(lambda: dist.all_reduce(small), 50)
    dist.destroy_process_group()
    return 2 * 0.5 * big.numel() * 4 / t_big / 1e9, t_small * 1e6


def _machine() -> Cluster:
    """This machine as a 'cluster' of single-thread processes, from micro-benchmarks."""
    from lightning_llmpar.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    a, b = torch.randn(1024, 384), torch.randn(384, 1024)
    gemm = 2 * 1024 * 384 * 1024 / _rate(lambda: a @ b) / 1e12
    x = torch.empty(8 * MiB)
    copy = 2 * x.numel() * 4 / _rate(lambda: x.mul_(1.0)) / 1e9
    q = torch.randn(8, 6, SEQ, 64)
    attention = 2 * 8 * SEQ * SEQ * 384 / _rate(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)) / 1e12
    shape = {"vocab_size": 32, "block_size": 8, "n_head": 2, "n_kv_head": 1, "n_embd": 16}
    tiny = {n: GPT(GPTConfig(n_layer=n, **shape)) for n in (2, 10)}
    idx = torch.randint(0, 32, (1, 8))
    step = {n: _rate(lambda m=m: m(idx).sum().backward(), 20) for n, m in tiny.items()}
    overhead = (step[10] - step[2]) / 8 / 3 * 1e6  # forward and backward of one tiny layer: ~3 forward passes
    bandwidth, latency = run_ranks(_links, 2)[0]
    return Cluster(gpus_per_node=2, memory_gb=24, peak_tflops=gemm, fp32_tflops=gemm, fp8_tflops=gemm,
                   hbm_gbps=copy, intra_node_gbps=bandwidth, inter_node_gbps=bandwidth, latency_us=latency,
                   matmul_efficiency=1.0, attention_efficiency=min(1.0, attention / gemm),
                   layer_overhead_us=overhead, comm_overlap=0.0, device="cpu",  # gloo's threads share the cores
                   fp8_matmul_efficiency=1.0, gemm_knee=0.0, link_efficiency=1.0, elementwise_passes=30.0)


def _spearman(xs: list[float], ys: list[float]) -> float:
    rank = lambda v: {i: r for r, i in enumerate(sorted(range(len(v)), key=v.__getitem__))}  # noqa: E731
    rx, ry = rank(xs), rank(ys)
    n = len(xs)
    return 1 - 6 * sum((rx[i] - ry[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def time_part(steps: int) -> dict[str, Any]:
    cluster = _machine()
    print("this machine as a cluster:", {k: round(v, 4) if isinstance(v, float) else v
                                         for k, v in cluster.__dict__.items()})
    spec = model_spec(MODEL)
    rows = []
    for world in (1, 2):
        layouts = [c for c in TIMED if c.world_size == world]
        per_rank = run_ranks(_measure_all, world, layouts, steps, "time", timeout=3000)
        for i, c in enumerate(layouts):
            measured = statistics.median(max(rank[i][k] for rank in per_rank) for k in range(2, steps))
            machine = Cluster(**{**cluster.__dict__, "gpus_per_node": world})
            predicted = predict_step_time(spec, c, SEQ, machine, PRECISIONS["32-true"])
            rows.append({"layout": c.label(), "measured_s": measured, "predicted_s": predicted.step,
                         "ratio": predicted.step / measured, "predicted_terms_s": predicted.as_dict()})
            print(f"  {c.label():<60} measured {measured:.3f} s  predicted {predicted.step:.3f} s"
                  f"  {predicted.step / measured:.2f}x")
    rho = _spearman([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows])
    print(f"rank correlation (Spearman) of predicted and measured step times: {rho:.2f}")
    return {"cluster": dict(cluster.__dict__), "steps": steps, "layouts": rows, "spearman": rho,
            "note": "one thread per process (the 2-core machine's cores); median of the steps after two warm-up"}


def memory_part(steps: int) -> dict[str, Any]:
    spec = model_spec(MODEL)
    by_world: dict[int, list[Candidate]] = defaultdict(list)
    for c in LAYOUTS:
        by_world[c.world_size].append(c)
    rows: list[dict[str, Any]] = []
    for world, layouts in sorted(by_world.items()):
        start = time.perf_counter()
        # One launch per world size: every rank runs each of its layouts in turn.
        per_rank = run_ranks(_measure_all, world, layouts, steps, timeout=3000)
        print(f"world {world}: {len(layouts)} layouts in {time.perf_counter() - start:.0f} s")
        for i, c in enumerate(layouts):
            measured = max(rank[i] for rank in per_rank)
            predicted = predict_memory(spec, c, SEQ, PRECISIONS["32-true"])
            rows.append({
                "layout": c.label(), "world_size": world, "measured_mib": measured / MiB,
                "measured_per_rank_mib": [rank[i] / MiB for rank in per_rank],
                "predicted_mib": predicted.peak / MiB, "error": predicted.peak / measured - 1,
                # The mesh puts the pipeline outermost: the first world/pp ranks hold its first stage(s).
                "predicted_per_pipeline_rank_mib": [
                    m.peak / MiB for m in predict_rank_memory(spec, c, SEQ, PRECISIONS["32-true"])],
                "predicted_terms_mib": {k: v / MiB for k, v in predicted.as_dict().items() if k != "rank"},
            })
            print(f"  {c.label():<60} measured {measured / MiB:7.1f} MiB  predicted {predicted.peak / MiB:7.1f} MiB"
                  f"  {rows[-1]['error']:+.1%}")
    worst = max(abs(r["error"]) for r in rows)
    print(f"{sum(abs(r['error']) <= 0.10 for r in rows)} of {len(rows)} layouts within 10%; worst {worst:.1%}")
    return {"steps": steps, "layouts": rows, "worst_abs_error": worst,
            "within_10_percent": sum(abs(r["error"]) <= 0.10 for r in rows),
            "measure": "glibc mallinfo2 after every op, minus the bytes in use before the model was built;"
                       " largest rank"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["memory", "time", "all"], default="all")
    parser.add_argument("--steps", type=int, default=3, help="memory part (the time part runs 8)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    result["setup"] = {"model": MODEL, "seq": SEQ, "precision": "32-true", "torch": torch.__version__,
                       "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    if args.part in ("memory", "all"):
        result["memory"] = memory_part(args.steps)
    if args.part in ("time", "all"):
        result["step_time"] = time_part(8)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
