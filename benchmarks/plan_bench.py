"""The planner's memory model against measured per-rank peaks, on this machine's CPU processes (gloo).

Each layout trains the example GPT for 3 steps; every rank samples its host bytes in use after each op
(``lightning_llmpar.planner.measure``); the largest rank's peak is compared with the planner's prediction for the
fullest rank. The model here (6 blocks, d=384, 128-token sequences) is not the one the memory model's terms were
checked on while it was written (4 blocks, d=256, 256 tokens).

Run from the repository root:  python -m benchmarks.plan_bench
Writes benchmarks/results/plan.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from lightning_llmpar.planner.candidate import Candidate
from lightning_llmpar.planner.cluster import PRECISIONS
from lightning_llmpar.planner.measure import measure_layout
from lightning_llmpar.planner.memory import predict_memory
from lightning_llmpar.planner.spec import model_spec
from tests.distributed import run_ranks

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


def _measure_all(layouts: list[Candidate], steps: int) -> list[int]:
    return [measure_layout(c, MODEL, SEQ, steps) for c in layouts]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    spec = model_spec(MODEL)
    by_world: dict[int, list[Candidate]] = defaultdict(list)
    for c in LAYOUTS:
        by_world[c.world_size].append(c)
    rows: list[dict[str, Any]] = []
    for world, layouts in sorted(by_world.items()):
        start = time.perf_counter()
        # One launch per world size: every rank runs each of its layouts in turn.
        per_rank = run_ranks(_measure_all, world, layouts, args.steps, timeout=3000)
        print(f"world {world}: {len(layouts)} layouts in {time.perf_counter() - start:.0f} s")
        for i, c in enumerate(layouts):
            measured = max(rank[i] for rank in per_rank)
            predicted = predict_memory(spec, c, SEQ, PRECISIONS["32-true"], "cpu")
            rows.append({
                "layout": c.label(), "world_size": world, "measured_mib": measured / MiB,
                "measured_per_rank_mib": [rank[i] / MiB for rank in per_rank],
                "predicted_mib": predicted.peak / MiB, "error": predicted.peak / measured - 1,
                "predicted_terms_mib": {k: v / MiB for k, v in predicted.as_dict().items() if k != "rank"},
            })
            print(f"  {c.label():<60} measured {measured / MiB:7.1f} MiB  predicted {predicted.peak / MiB:7.1f} MiB"
                  f"  {rows[-1]['error']:+.1%}")
    worst = max(abs(r["error"]) for r in rows)
    result = {
        "setup": {"model": MODEL, "seq": SEQ, "steps": args.steps, "precision": "32-true", "torch": torch.__version__,
                  "machine": platform.processor() or platform.machine(), "measure": "glibc mallinfo2 after every op,"
                  " minus the bytes in use before the model was built; largest rank"},
        "layouts": rows,
        "worst_abs_error": worst,
        "within_10_percent": sum(abs(r["error"]) <= 0.10 for r in rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{result['within_10_percent']} of {len(rows)} layouts within 10%; worst {worst:.1%}; wrote {args.out}")


if __name__ == "__main__":
    main()
