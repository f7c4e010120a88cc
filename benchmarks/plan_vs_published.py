"""The planner against torchtitan's published H100 runs: each row's exact layout predicted, next to its figures.

Reads ``benchmarks/published/torchtitan_llama3_h100_202412.json`` (every row of tables 1-6 of torchtitan's
``benchmarks/llama3_h100_202412_torchtitan.md``) and the Llama 3.1 shapes beside it, predicts tokens/s per GPU
and the peak reserved memory of the fullest GPU on the ``h100-hbm2e`` preset (one set of constants for every
row), and writes both with their relative errors and Spearman's rank correlation to
``benchmarks/results/plan_vs_published.json``. ``--markdown`` prints the table docs/planner.md shows.

    python -m benchmarks.plan_vs_published [--markdown]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_llmpar.planner import Candidate, cluster_from, predict_memory, predict_step_time
from lightning_llmpar.planner.cluster import PRECISIONS
from lightning_llmpar.planner.spec import llama_spec

HERE = Path(__file__).resolve().parent
ROWS = HERE / "published" / "torchtitan_llama3_h100_202412.json"
CONFIGS = HERE / "published" / "llama3_1_configs.json"
OUT = HERE / "results" / "plan_vs_published.json"
GiB = 2**30
TARGET = 0.15


def candidate(row: dict[str, Any]) -> Candidate:
    """The row's layout as torchtitan ran it: FSDP2 units are blocks, resharded after forward (ZeRO-3) except
    under a pipeline (ZeRO-2 there); the pipeline splits the local batch into ``pp`` microbatches and the blocks by
    torchtitan's default split; the loss is vocabulary-parallel under tensor parallelism."""
    deg = row["layout"]
    pp, microbatches = deg["pp"], row["pipeline_microbatches"]
    return Candidate(
        tp=deg["tp"], pp=pp, dp=deg["dp_shard"], cp=deg["cp"], zero=3 if pp == 1 else 2,
        checkpointing=row["activation_checkpointing"], micro_batch=row["local_batch"] // microbatches,
        microbatches=microbatches, schedule=row["pipeline_schedule"], virtual=row["pipeline_virtual_stages"],
        compile=row["compile"], float8=row["float8"], async_tp=row["async_tp"], loss_parallel=deg["tp"] > 1,
        fsdp_per_block=True, keeps_outputs=True, stage_split="torchtitan",
    )


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def compare(cluster_name: str = "h100-hbm2e") -> dict[str, Any]:
    published = json.loads(ROWS.read_text())
    shapes = json.loads(CONFIGS.read_text())["models"]
    out = []
    for row in published["rows"]:
        spec = llama_spec(row["model"], **shapes[row["model"]])
        c = candidate(row)
        cluster = cluster_from(cluster_name, nodes=max(1, row["gpus"] // 8))
        assert c.world_size == row["gpus"], (row, c)
        p = PRECISIONS["fp8" if c.float8 else "bf16-mixed"]
        time = predict_step_time(spec, c, row["seq"], cluster, p)
        memory = predict_memory(spec, c, row["seq"], p, cuda=True)
        tps = time.tokens_per_s / c.world_size
        gib = memory.peak / GiB
        out.append({
            "table": row["table"], "label": row["label"], "model": row["model"], "gpus": row["gpus"],
            "seq": row["seq"], "layout": c.label(),
            "published_tps_per_gpu": row["published_tps_per_gpu"], "predicted_tps_per_gpu": round(tps, 1),
            "tps_error": round(tps / row["published_tps_per_gpu"] - 1, 4),
            "published_memory_gib": row["published_memory_gib"], "predicted_memory_gib": round(gib, 2),
            "memory_error": round(gib / row["published_memory_gib"] - 1, 4),
            "predicted_step_s": round(time.step, 3),
            "time_terms_s": {k: round(v, 4) for k, v in time.as_dict().items() if k not in ("tokens_per_s", "mfu")},
            "memory_terms_gib": {k: round(v / GiB, 2) for k, v in memory.as_dict().items() if k != "rank"},
            "memory_rank": memory.rank,
        })
    tps_pub = [r["published_tps_per_gpu"] for r in out]
    mem_pub = [r["published_memory_gib"] for r in out]
    outside = [f"table {r['table']} {r['label']}: " + ", ".join(
        f"{k} {r[k + '_error']:+.1%}" for k in ("tps", "memory") if abs(r[k + "_error"]) > TARGET)
        for r in out if abs(r["tps_error"]) > TARGET or abs(r["memory_error"]) > TARGET]
    return {
        "source": published["source"], "notes": published["notes"], "cluster": asdict(cluster_from(cluster_name)),
        "target": f"every row within +-{TARGET:.0%} on tokens/s/GPU and memory; Spearman >= 0.9",
        "rows": out,
        "spearman_tps": round(spearman([r["predicted_tps_per_gpu"] for r in out], tps_pub), 4),
        "spearman_memory": round(spearman([r["predicted_memory_gib"] for r in out], mem_pub), 4),
        "max_abs_tps_error": max(abs(r["tps_error"]) for r in out),
        "max_abs_memory_error": max(abs(r["memory_error"]) for r in out),
        "rows_outside_target": outside,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = ["| table | run | GPUs | seq | tok/s/GPU published | predicted | error | GiB published | predicted | error |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        lines.append(f"| {r['table']} | {r['model'].removeprefix('llama3.1-').upper()} {r['label']} | {r['gpus']} |"
                     f" {r['seq']} | {r['published_tps_per_gpu']:,} | {r['predicted_tps_per_gpu']:,.0f} |"
                     f" {r['tps_error']:+.1%} | {r['published_memory_gib']} | {r['predicted_memory_gib']:.1f} |"
                     f" {r['memory_error']:+.1%} |")
    lines.append("")
    lines.append(f"Spearman rank correlation, predicted vs published: tokens/s/GPU {result['spearman_tps']:.3f},"
                 f" memory {result['spearman_memory']:.3f}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--markdown", action="store_true", help="also print the table for docs/planner.md")
    args = parser.parse_args()
    result = compare()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in result["rows"]:
        print(f"T{r['table']} {r['model']:<14} {r['label']:<32} tps {r['published_tps_per_gpu']:>6} vs"
              f" {r['predicted_tps_per_gpu']:>8.0f} ({r['tps_error']:+.1%})   GiB {r['published_memory_gib']:>5} vs"
              f" {r['predicted_memory_gib']:>6.1f} ({r['memory_error']:+.1%})")
    print(f"spearman tps {result['spearman_tps']:.3f} memory {result['spearman_memory']:.3f}; outside"
          f" +-{TARGET:.0%}: {len(result['rows_outside_target'])}")
    if args.markdown:
        print(markdown(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
