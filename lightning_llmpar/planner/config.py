"""A planned layout as a `llmpar fit` config: the strategy's degrees, checkpointing, precision and batching."""

from __future__ import annotations

from typing import Any, Protocol

import yaml

from lightning_llmpar.planner.candidate import Candidate
from lightning_llmpar.planner.cluster import Cluster, Precision
from lightning_llmpar.planner.memory import MemoryEstimate
from lightning_llmpar.planner.spec import ModelSpec
from lightning_llmpar.planner.speed import TimeEstimate


# What a config is written from: a plan (search.Plan) and one of its rows (search.PlannedLayout), named by the
# fields read here so that this module needs nothing from the search that calls it.
class Plan(Protocol):
    spec: ModelSpec
    cluster: Cluster
    precision: Precision
    global_batch: int
    seq: int


class PlannedLayout(Protocol):
    candidate: Candidate
    time: TimeEstimate
    memory: MemoryEstimate

__all__ = ["fit_config", "strategy_args"]


def strategy_args(c: Candidate) -> dict[str, Any]:
    """``LLMParallelStrategy`` keyword arguments of a candidate."""
    args: dict[str, Any] = {"data_parallel": c.dp, "tensor_parallel": c.tp, "pipeline_parallel": c.pp,
                            "zero_stage": c.zero}
    if c.zero and c.dp_replicate > 1:
        args["data_parallel_replicate"] = c.dp_replicate
    if c.tp > 1:
        args["sequence_parallel"] = c.sequence_parallel
    if c.pp > 1:
        args.update(pipeline_schedule=c.schedule, pipeline_microbatches=c.microbatches,
                    pipeline_virtual_stages=c.virtual)
    if c.cp > 1:
        args["context_parallel"] = c.cp
    if c.ep > 1:
        args["expert_parallel"] = c.ep
    if c.compile:
        args["compile"] = True
    return args


def fit_config(plan: Plan, row: PlannedLayout) -> str:
    """YAML text for ``row``: the data module's batch is one data-parallel rank's share of the global batch
    (a pipeline splits it into microbatches; without one, gradients accumulate over ``microbatches``)."""
    c = row.candidate
    trainer: dict[str, Any] = {
        "accelerator": "gpu" if plan.cluster.device == "cuda" else "cpu",
        "devices": plan.cluster.gpus_per_node,
        "num_nodes": plan.cluster.nodes,
        "strategy": {"class_path": "lightning_llmpar.LLMParallelStrategy", "init_args": strategy_args(c)},
    }
    if plan.precision.name == "bf16-mixed":
        trainer["precision"] = "bf16-mixed"
    elif plan.precision.name == "fp8":
        recipe = c.float8 or "tensorwise"
        trainer["plugins"] = [{"class_path": "lightning_llmpar.FP8Precision",
                               "init_args": {"recipe": recipe, "float8_all_gather": recipe == "tensorwise"}}]
    if c.pp == 1 and c.microbatches > 1:
        trainer["accumulate_grad_batches"] = c.microbatches
    if c.checkpointing != "none":
        # torchtitan's op policy is nearest to keeping every matmul's output; every 2nd block is every_k.
        ac = {"selective_op": {"mode": "selective", "save": "attention_and_matmuls"},
              "every_2": {"mode": "every_k", "every": 2}}.get(c.checkpointing, {"mode": c.checkpointing})
        trainer["callbacks"] = [{"class_path": "lightning_llmpar.ActivationCheckpointing", "init_args": ac}]
    model = dict(plan.spec.fit_model)
    per_rank = c.micro_batch * (c.microbatches if c.pp > 1 else 1)
    config = {
        "seed_everything": 1234,
        "trainer": trainer,
        "model": model,
        "data": {"class_path": "lightning_llmpar.data.CorpusDataModule",
                 "init_args": {"block_size": plan.seq, "batch_size": per_rank}},
    }
    t, m = row.time, row.memory
    header = (
        f"# Written by `llmpar plan` for {plan.spec.name} on {plan.cluster.nodes} node(s) x"
        f" {plan.cluster.gpus_per_node} {plan.cluster.device}\n"
        f"# ({plan.cluster.memory_gb:g} GB each), global batch {plan.global_batch} x {plan.seq} tokens,"
        f" {plan.precision.name}.\n"
        f"# Layout {c.label()}\n"
        f"# Predicted: peak {m.peak / 2**30:.2f} GiB per device (pipeline rank {m.rank}), step {t.step:.4f} s,"
        f" {t.tokens_per_s:.0f} tokens/s, MFU {t.mfu:.1%}.\n"
        + ("# Async tensor parallelism is assumed by the prediction; the strategy has no such option.\n"
           if c.async_tp else "")
        + "# The data section is the bundled corpus; put your own DataModule there with the same batch_size.\n"
        "# Run: llmpar fit --config <this file>\n"
    )
    return header + yaml.safe_dump(config, sort_keys=False)
