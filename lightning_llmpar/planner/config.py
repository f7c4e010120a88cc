"""A planned layout as a `llmpar fit` config: the strategy's degrees, checkpointing, precision and batching."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import yaml

from lightning_llmpar.planner.candidate import Candidate
from lightning_llmpar.planner.cluster import Cluster, Precision
from lightning_llmpar.planner.memory import MemoryEstimate, gib_text
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
    source: dict[str, Any]


class PlannedLayout(Protocol):
    candidate: Candidate
    time: TimeEstimate
    memory: MemoryEstimate

__all__ = ["check_writable", "fit_config", "source_sections", "strategy_args"]

# Trainer settings a plan decides; the source config's others (the run's length, logging, validation) are kept.
_PLANNED = {"accelerator", "devices", "num_nodes", "strategy", "precision", "plugins", "accumulate_grad_batches"}
# Strategy arguments a plan decides (or that hold only for the source's layout: its split points; its offload, which
# the plan's memory does without); the source's others (the checkpoint to start from, the loss normalization) are kept.
_LAYOUT = {"data_parallel", "data_parallel_replicate", "tensor_parallel", "pipeline_parallel", "zero_stage",
           "sequence_parallel", "pipeline_schedule", "pipeline_microbatches", "pipeline_virtual_stages",
           "pipeline_split_points", "context_parallel", "expert_parallel", "compile", "cpu_offload"}
_CORPUS = "lightning_llmpar.data.CorpusDataModule"
HEADER = "# Written by `llmpar plan`"  # how a config the planner may replace begins


def source_sections(model: Any) -> dict[str, Any]:
    """The sections other than ``model:`` of the `llmpar fit` YAML a plan is made from (empty for other sources)."""
    path = Path(model) if isinstance(model, (str, Path)) else None
    if path is None or path.suffix not in (".yaml", ".yml") or not path.is_file():
        return {}
    loaded = yaml.safe_load(path.read_text()) or {}
    return {key: value for key, value in loaded.items() if key != "model"}


def check_writable(path: str | Path) -> Path:
    """``path``, refused if it names a file `llmpar plan` did not write (a user's config, often the source)."""
    path = Path(path)
    if path.exists() and not (path.is_file() and path.read_text(errors="replace").startswith(HEADER)):
        raise ValueError(f"{path} exists and was not written by `llmpar plan`: give --write a new file name.")
    return path


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [] if value is None else [value]


def _data_section(source: Any, block_size: int, batch_size: int) -> dict[str, Any]:
    """The source's data section (default: the bundled corpus) with the plan's batch and, where it takes one,
    sequence length."""
    source = dict(source or {})
    class_path = source.pop("class_path", _CORPUS)
    args = dict(source.pop("init_args", {}) or {}) if "init_args" in source else source
    if class_path == _CORPUS or "block_size" in args:
        args["block_size"] = block_size
    args["batch_size"] = batch_size
    return {"class_path": class_path, "init_args": args}


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


def _source_strategy_args(strategy: Any) -> dict[str, Any]:
    """The source's ``LLMParallelStrategy`` arguments a plan does not decide (none from another strategy)."""
    if not (isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith("LLMParallelStrategy")):
        return {}
    return {k: v for k, v in (strategy.get("init_args") or {}).items() if k not in _LAYOUT}


def fit_config(plan: Plan, row: PlannedLayout) -> str:
    """YAML text for ``row``: the data module's batch is one data-parallel rank's share of the global batch
    (a pipeline splits it into microbatches; without one, gradients accumulate over ``microbatches``)."""
    c = row.candidate
    source = plan.source
    kept = {k: v for k, v in (source.get("trainer") or {}).items() if k not in _PLANNED}
    trainer: dict[str, Any] = {
        "accelerator": "gpu" if plan.cluster.device == "cuda" else "cpu",
        "devices": plan.cluster.gpus_per_node,
        "num_nodes": plan.cluster.nodes,
        "strategy": {"class_path": "lightning_llmpar.LLMParallelStrategy",
                     "init_args": {**_source_strategy_args((source.get("trainer") or {}).get("strategy")),
                                   **strategy_args(c)}},
    }
    if plan.precision.name == "bf16-mixed":
        trainer["precision"] = "bf16-mixed"
    elif plan.precision.name == "fp8":
        recipe = c.float8 or "tensorwise"
        # Every block's linears in fp8 and the head in bf16, as predicted (and as torchtitan converts): FP8Precision's
        # default keeps the first and last block in bf16 too, which with two blocks leaves nothing to convert.
        trainer["plugins"] = [{"class_path": "lightning_llmpar.FP8Precision",
                               "init_args": {"recipe": recipe, "float8_all_gather": recipe == "tensorwise",
                                             "keep_first_last": False, "skip": ["lm_head"]}}]
    if c.pp == 1 and c.microbatches > 1:
        trainer["accumulate_grad_batches"] = c.microbatches
    trainer.update(kept)
    if c.checkpointing != "none":
        # torchtitan's op policy is nearest to keeping every matmul's output; every 2nd block is every_k.
        ac = {"selective_op": {"mode": "selective", "save": "attention_and_matmuls"},
              "every_2": {"mode": "every_k", "every": 2}}.get(c.checkpointing, {"mode": c.checkpointing})
        planned_ac = [{"class_path": "lightning_llmpar.ActivationCheckpointing", "init_args": ac}]
    else:
        planned_ac = []
    # The source's callbacks stay, but its activation checkpointing is the plan's to choose.
    callbacks = [cb for cb in _as_list(kept.get("callbacks"))
                 if not str(cb.get("class_path", "") if isinstance(cb, dict) else cb).endswith("ActivationCheckpointing")]
    trainer.pop("callbacks", None)
    if callbacks + planned_ac:
        trainer["callbacks"] = callbacks + planned_ac
    bounded = any(trainer.get(k) not in (None, -1) for k in ("max_steps", "max_epochs", "max_time"))
    if not bounded:  # Lightning's default is 1000 epochs; the example modules' schedules default to 1000 steps
        trainer["max_steps"] = 1000
    per_rank = c.micro_batch * (c.microbatches if c.pp > 1 else 1)
    config = {
        **{k: v for k, v in source.items() if k not in ("trainer", "data")},  # e.g. ckpt_path, optimizer
        "seed_everything": source.get("seed_everything", 1234),
        "trainer": trainer,
        "model": dict(plan.spec.fit_model),
        "data": _data_section(source.get("data"), plan.seq, per_rank),
    }
    t, m = row.time, row.memory
    header = (
        f"{HEADER} for {plan.spec.name} on {plan.cluster.nodes} node(s) x"
        f" {plan.cluster.gpus_per_node} {plan.cluster.device}\n"
        f"# ({plan.cluster.memory_gb:g} GB each), global batch {plan.global_batch} x {plan.seq} tokens,"
        f" {plan.precision.name}.\n"
        f"# Layout {c.label()}\n"
        f"# Predicted: peak {gib_text(m.peak)} GiB per device (pipeline rank {m.rank}), step {t.step:.4f} s,"
        f" {t.tokens_per_s:.0f} tokens/s, MFU {t.mfu:.1%}.\n"
        + ("# Async tensor parallelism is assumed by the prediction; the strategy has no such option.\n"
           if c.async_tp else "")
        + ("# Trainer and data settings not planned are those of the source config.\n" if source else
           "# The data section is the bundled corpus; put your own DataModule there with the same batch_size.\n")
        + ("" if bounded else "# trainer.max_steps: 1000 (no length given); set the run's length there.\n")
        + "# Run: llmpar fit --config <this file>\n"
    )
    return header + yaml.safe_dump(config, sort_keys=False)
