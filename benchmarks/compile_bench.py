"""compile=True measured: the example GPT (6 blocks, d=384, 128 tokens, 4 samples per rank) at dp2, eager vs every
block compiled (inductor on CPU), at ZeRO-0 and ZeRO-3, in interleaved rounds inside one launch of two gloo ranks.
The compile time falls in the warm-up steps; the median seconds per measured step are compared.

Run from the repository root:  python -m benchmarks.compile_bench [--rounds 3] [--steps 12] [--warmup 4]
Writes benchmarks/results/compile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from benchmarks.vs_lightning import BATCH, MODEL, _rounds
from tests.distributed import run_ranks

OUT = Path(__file__).parent / "results" / "compile.json"
PAIRS = [("llmpar_zero0_compile", "llmpar_zero0"), ("llmpar_zero3_compile", "llmpar_zero3")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    names = sorted({n for pair in PAIRS for n in pair})
    runs = run_ranks(_rounds, 2, names, args.rounds, args.steps, args.warmup, timeout=3000)[0]
    seconds = {n: statistics.median(v) if isinstance(v, list) and v else v for n, v in runs.items()}
    speedups = {compiled: seconds[eager] / seconds[compiled] for compiled, eager in PAIRS
                if isinstance(seconds[compiled], float) and isinstance(seconds[eager], float)}
    result = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "model": MODEL, "batch_per_rank": BATCH, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "seconds_per_step_median": seconds, "rounds_seconds": runs, "speedup_compiled_over_eager": speedups,
        "target_1.2x_on_cpu": {k: v >= 1.2 for k, v in speedups.items()},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    print(json.dumps({"seconds": seconds, "speedup": speedups}, indent=1))


if __name__ == "__main__":
    main()
