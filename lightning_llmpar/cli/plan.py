"""`llmpar plan`: predict memory and step time of every layout of a model on a cluster, and write the best."""

from __future__ import annotations

import argparse

from lightning_llmpar.planner.cluster import CLUSTERS, cluster_from
from lightning_llmpar.planner.config import check_writable
from lightning_llmpar.planner.search import Plan, plan

__all__ = ["plan_command"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmpar plan", description=plan_command.__doc__)
    parser.add_argument("model", help="a Hugging Face config directory (or config.json), a LitGPT checkpoint"
                        " directory (or its model_config.yaml) or a llmpar fit YAML")
    parser.add_argument("--cluster", default="h100", choices=sorted(CLUSTERS), help="preset the flags below override")
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--memory-gb", type=float, help="memory per device")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak per device")
    parser.add_argument("--hbm-gbps", type=float, help="memory bandwidth per device")
    parser.add_argument("--intra-node-gbps", type=float, help="per-device bandwidth inside a node")
    parser.add_argument("--inter-node-gbps", type=float, help="per-device bandwidth between nodes")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--precision", default="bf16-mixed", choices=["32-true", "bf16-mixed", "fp8"])
    parser.add_argument("--compile", action="store_true", help="blocks compiled (torch.compile): fused elementwise ops")
    parser.add_argument("--float8", choices=["tensorwise", "rowwise"],
                        help="the blocks' linears in torchao float8 (tensorwise: FP8 all-gather under FSDP)")
    parser.add_argument("--async-tp", action="store_true",
                        help="tensor-parallel collectives overlapped with their matmuls (predicted only)")
    parser.add_argument("--headroom", type=float, default=0.1, help="fraction of device memory left free")
    parser.add_argument("--top", type=int, default=10, help="layouts shown")
    parser.add_argument("--json", action="store_true", help="print the ranked layouts as JSON instead of a table")
    parser.add_argument("--write", metavar="YAML", help="write the best layout as a llmpar fit config")
    return parser


def _plan(opts: argparse.Namespace) -> Plan:
    if opts.top < 1:
        raise ValueError(f"--top {opts.top}: give how many layouts to show, 1 or more.")
    if opts.write:
        check_writable(opts.write)  # before planning, not after
    cluster = cluster_from(
        opts.cluster, gpus_per_node=opts.gpus_per_node, nodes=opts.nodes, memory_gb=opts.memory_gb,
        peak_tflops=opts.peak_tflops, hbm_gbps=opts.hbm_gbps, intra_node_gbps=opts.intra_node_gbps,
        inter_node_gbps=opts.inter_node_gbps,
    )
    return plan(
        opts.model,
        cluster,
        global_batch=opts.global_batch,
        seq=opts.seq,
        precision=opts.precision,
        headroom=opts.headroom,
        compile=opts.compile,
        float8=opts.float8,
        async_tp=opts.async_tp,
    )


def plan_command(args: list[str]) -> int:
    """Rank the layouts (data x tensor x pipeline x context parallel, ZeRO stage, activation checkpointing,
    microbatching) of a model on a cluster by predicted step time among those whose predicted per-device peak
    memory fits; print them and optionally write the best as a `llmpar fit` config."""
    parser = _parser()
    opts = parser.parse_args(args)
    try:
        result = _plan(opts)
        print(result.to_json(opts.top) if opts.json else result.table(opts.top))
        if opts.write:
            path = result.write_config(opts.write)
            if not opts.json:
                print(f"llmpar: best layout written to {path} (llmpar fit --config {path})")
    except ValueError as e:  # bad input: one line naming the values and the fix, as argparse reports its own
        parser.error(str(e))
    return 0 if result.best is not None else 1
