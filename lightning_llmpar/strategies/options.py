"""LLMParallelStrategy's keyword arguments, validated at construction, before any process is launched."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, get_args

import torch.distributed

from lightning_llmpar.checkpointing.hf_checkpoint import check_hf_directory
from lightning_llmpar.checkpointing.litgpt_checkpoint import check_litgpt_directory
from lightning_llmpar.context_parallel.attention import MODES as CP_MODES
from lightning_llmpar.data_parallel.compression.methods import CompressionConfig
from lightning_llmpar.fault_tolerance.diloco import DiLoCoConfig, check_data_parallel_sync
from lightning_llmpar.fault_tolerance.replica_env import check_fault_tolerance
from lightning_llmpar.layout import ZERO_STAGES
from lightning_llmpar.pipeline.setup import ZERO_BUBBLE_SCHEDULES, PipelineConfig
from lightning_llmpar.tensor_parallel.entries import check_plan_entries
from lightning_llmpar.training.loss_normalization import count_target_tokens

__all__ = ["START_METHODS", "BACKENDS", "StrategyOptions", "validate_options"]

START_METHODS = Literal["popen", "spawn", "fork", "forkserver"]
BACKENDS = Literal["fsdp2", "deepspeed"]


@dataclass(frozen=True)
class StrategyOptions:
    """Everything the strategy was given, checked and normalized once, at construction; never changed after (a
    preset or a derived layout builds a new one with ``dataclasses.replace``)."""

    degrees: Mapping[str, Any]
    pipeline: PipelineConfig
    backend: str
    compression: CompressionConfig | None
    deepspeed: dict[str, Any] = field(default_factory=dict)
    hf_checkpoint: str | None = None
    litgpt_checkpoint: str | None = None
    block_stack: str | None = None
    pipeline_check: bool = True
    count_tokens: Callable[[Any], int] | None = None
    context_parallel_mode: str = "ring"
    fused_optimizer: bool = True
    sequence_parallel: bool = True
    tp_plan: Mapping[str, Any] = field(default_factory=dict)
    cpu_offload: bool = False
    expert_capacity_factor: float | None = None
    compile: bool = False
    start_method: str = "popen"
    loss_parallel: bool | str = "auto"
    async_checkpoint: bool = False
    checkpoint_weights_only: bool | None = None  # False: checkpoints are trusted (plain unpickling, DeepSpeed's)
    fault_tolerance: str | None = None
    diloco: DiLoCoConfig | None = None  # data_parallel_sync='diloco': replica groups sync every `every` steps
    timeout: timedelta | None = None  # the process groups' timeout (None: torch's default)


def positive_int(name: str, value: Any, allow_auto: bool = False) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = " or 'auto'" if allow_auto else ""
        raise ValueError(f"LLMParallelStrategy: `{name}` must be a positive integer{extra}, got {value!r}.")


def _check_degrees(a: dict[str, Any]) -> None:
    positive_int("tensor_parallel", a["tensor_parallel"])
    positive_int("pipeline_parallel", a["pipeline_parallel"])
    positive_int("data_parallel", a["data_parallel"], allow_auto=True)
    if a["data_parallel_replicate"] != "num_nodes":
        positive_int("data_parallel_replicate", a["data_parallel_replicate"], allow_auto=True)
    if a["zero_stage"] not in ZERO_STAGES:
        raise ValueError(f"LLMParallelStrategy: `zero_stage` must be one of {ZERO_STAGES}, got {a['zero_stage']!r}.")
    flags = ("sequence_parallel", "cpu_offload", "pipeline_check", "compile", "fused_optimizer", "async_checkpoint")
    for name in flags:
        if not isinstance(a[name], bool):
            raise ValueError(f"LLMParallelStrategy: `{name}` must be True or False, got {a[name]!r}.")
    if a["cpu_offload"] and a["zero_stage"] == 0:
        raise ValueError(
            "LLMParallelStrategy: cpu_offload=True needs sharded state to offload; set zero_stage to 1, 2 or 3."
        )


def _check_loss_parallel(a: dict[str, Any]) -> None:
    value = a["loss_parallel"]
    if not (isinstance(value, bool) or value == "auto"):
        raise ValueError(
            f"LLMParallelStrategy: `loss_parallel` must be True, False or 'auto', got {value!r}. 'auto' (the default)"
            " keeps the LM head's logits split over the vocabulary under tensor parallelism and gathers them for ops"
            " other than the cross-entropy; True refuses such ops."
        )
    if value is True and a["tensor_parallel"] == 1:
        raise ValueError(
            "LLMParallelStrategy: loss_parallel=True splits the LM head's logits over the tensor-parallel ranks, but"
            " tensor_parallel=1. Set tensor_parallel > 1, or leave loss_parallel='auto'."
        )


def _refuse_clashes(what: str, others: dict[str, bool], why: str) -> None:
    clash = [name for name, on in others.items() if on]
    if clash:
        raise ValueError(f"LLMParallelStrategy: {what} does not combine with {', '.join(clash)}{why}")


def _check_context_parallel(a: dict[str, Any]) -> None:
    positive_int("context_parallel", a["context_parallel"])
    if a["context_parallel_mode"] not in CP_MODES:
        raise ValueError(
            f"LLMParallelStrategy: `context_parallel_mode` must be one of {CP_MODES}, got {a['context_parallel_mode']!r}."
        )
    if a["context_parallel"] == 1:
        return
    others = {
        "sharding_backend='deepspeed'": a["sharding_backend"] == "deepspeed",
        "gradient_compression": a["gradient_compression"] is not None,
    }
    _refuse_clashes(
        f"context_parallel={a['context_parallel']}", others,
        " yet (each rank's loss weight and the sequence cut live outside the DeepSpeed engine and the compression"
        " hooks). Use tensor_parallel, pipeline_parallel and data_parallel with context_parallel, or context_parallel=1.",
    )


def _check_expert_parallel(a: dict[str, Any], zero_bubble: bool) -> None:
    positive_int("expert_parallel", a["expert_parallel"])
    factor = a["expert_capacity_factor"]
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf):
        raise ValueError(
            f"LLMParallelStrategy: `expert_capacity_factor` must be a positive number (1.25 lets each expert take 25%"
            f" more than its even share of tokens) or None (drop nothing), got {factor!r}."
        )
    if factor is not None and a["sharding_backend"] == "deepspeed":
        raise ValueError(
            f"LLMParallelStrategy: expert_capacity_factor={factor!r} is applied to the MoE layers when the strategy"
            " composes the model, which the DeepSpeed engine does itself: it would be ignored. Use"
            " sharding_backend='fsdp2' (the default) for a capacity cut, or leave expert_capacity_factor=None."
        )
    if a["expert_parallel"] == 1:
        return
    others = {
        "context_parallel": a["context_parallel"] > 1,
        "sharding_backend='deepspeed'": a["sharding_backend"] == "deepspeed",
        "gradient_compression": a["gradient_compression"] is not None,
        f"pipeline_schedule={a['pipeline_schedule']!r}": zero_bubble,
    }
    _refuse_clashes(
        f"expert_parallel={a['expert_parallel']}", others,
        ": experts are their own FSDP units over the data-parallel ranks outside the expert-parallel group, which the"
        " DeepSpeed engine, the compression hooks and the zero-bubble schedules (split weight gradients) do not handle."
        " Use expert_parallel with tensor_parallel, data_parallel (ZeRO 0-3) and the pipeline schedules GPipe, 1F1B,"
        " Interleaved1F1B or LoopedBFS.",
    )


def _check_compile(a: dict[str, Any], zero_bubble: bool) -> None:
    if not (a["compile"] and zero_bubble):
        return
    # Measured: with donated buffers off (so the split backward runs at all), ZBVZeroBubble's losses drift from one
    # process after the first step; torch's own schedules refuse compiled stage modules.
    raise ValueError(
        f"LLMParallelStrategy: compile=True does not combine with pipeline_schedule={a['pipeline_schedule']!r}: the"
        " zero-bubble schedules run each stage's backward in two passes (input gradients, then weight gradients),"
        " which a compiled block's single backward does not support. Use pipeline_schedule='Interleaved1F1B' (the"
        " default), '1F1B', 'GPipe' or 'LoopedBFS' with compile=True, or compile=False."
    )


def _check_pipeline(a: dict[str, Any]) -> PipelineConfig:
    if a["pipeline_parallel"] == 1:
        # Options of a pipeline that does not exist would be silently ignored.
        given = {
            "pipeline_schedule": a["pipeline_schedule"] if a["pipeline_schedule"] != "Interleaved1F1B" else None,
            "pipeline_microbatches": a["pipeline_microbatches"],
            "pipeline_virtual_stages": a["pipeline_virtual_stages"],
            "pipeline_split_points": a["pipeline_split_points"],
        }
        given = {k: v for k, v in given.items() if v is not None}
        if given:
            raise ValueError(
                f"LLMParallelStrategy: {', '.join(f'{k}={v!r}' for k, v in given.items())} configure pipeline"
                " parallelism, but pipeline_parallel=1. Set pipeline_parallel > 1 or remove them."
            )
    return PipelineConfig.validated(
        a["pipeline_parallel"], a["pipeline_schedule"], a["pipeline_microbatches"], a["pipeline_virtual_stages"],
        a["pipeline_split_points"], a["zero_stage"],
    )


def _check_process_group_backend(name: Any) -> None:
    # Lightning passes it to init_process_group as given, which fails only after the processes have started.
    known = [b for b in torch.distributed.Backend.backend_list if b not in ("undefined", "fake")]
    parts = [p.split(":")[-1].strip().lower() for p in name.split(",")] if isinstance(name, str) else [None]
    if name is not None and not all(p in known for p in parts):
        raise ValueError(
            f"`process_group_backend` must be None (gloo on CPU, nccl on CUDA) or a torch.distributed backend such as"
            f" {known} (or per device, 'cpu:gloo,cuda:nccl'), got {name!r}."
        )


def _check_backend(a: dict[str, Any]) -> tuple[dict[str, Any], CompressionConfig | None]:
    backend, compression = a["sharding_backend"], a["gradient_compression"]
    if backend not in get_args(BACKENDS):
        raise ValueError(f"`sharding_backend` must be one of {get_args(BACKENDS)}, got {backend!r}.")
    deepspeed = {k: a[k] for k in ("deepspeed_config", "offload_optimizer", "offload_parameters", "gradient_compression")}
    if backend == "fsdp2":
        given = sorted(k for k, v in deepspeed.items() if v is not None and k != "gradient_compression")
        if given:
            raise ValueError(
                f"{', '.join(given)} apply to sharding_backend='deepspeed' only. With the default 'fsdp2'"
                " backend use cpu_offload=True for offloading."
            )
        if compression is None:
            return deepspeed, None
        config = CompressionConfig.from_user(compression)
        zero = a["zero_stage"]
        config.check_layout(zero, hybrid=zero > 0 and a["data_parallel_replicate"] not in ("auto", 1))
        return deepspeed, config
    if compression is not None and not isinstance(compression, str):
        raise ValueError(
            f"gradient_compression={compression!r} configures the 'fsdp2' backend's compressors; with"
            " sharding_backend='deepspeed' use 'onebit_adam' or 'zero_one_adam'."
        )
    if a["compile"]:
        raise ValueError(
            "compile=True compiles the blocks inside the FSDP2 composition; the DeepSpeed engine wraps the model"
            " itself. Use sharding_backend='fsdp2' (the default) with compile=True, or compile=False."
        )
    if a["loss_normalization"] != "mean":
        raise ValueError(
            "loss_normalization='tokens' rescales gradients before the optimizer step, which the DeepSpeed engine"
            " takes itself; use it with sharding_backend='fsdp2' (the default)."
        )
    if a["async_checkpoint"]:
        raise ValueError(
            "async_checkpoint=True writes checkpoints with torch's distributed checkpoint (DCP) in the background; the"
            " DeepSpeed engine writes its own checkpoints synchronously. Use sharding_backend='fsdp2' (the default)"
            " with async_checkpoint=True, or async_checkpoint=False."
        )
    return deepspeed, None


def process_group_timeout(value: Any) -> timedelta | None:
    """``timeout`` as a ``timedelta``: a number is seconds (a YAML config or ``--trainer.strategy.timeout 600``)."""
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    timeout = timedelta(seconds=value) if number else value
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise ValueError(
            f"LLMParallelStrategy: `timeout` must be a positive number of seconds or a datetime.timedelta, got"
            f" {value!r}; for example timeout=600 or timeout=timedelta(minutes=10)."
        )
    return timeout


def validate_options(a: dict[str, Any]) -> StrategyOptions:
    """Check the strategy's keyword arguments ``a`` (names as in ``LLMParallelStrategy.__init__``)."""
    _check_degrees(a)
    _check_loss_parallel(a)
    _check_context_parallel(a)
    pipeline = _check_pipeline(a)
    # The schedule's canonical name (names are case-insensitive): these split backward into input and weight passes.
    zero_bubble = pipeline.degree > 1 and pipeline.schedule in ZERO_BUBBLE_SCHEDULES
    _check_expert_parallel(a, zero_bubble)
    _check_compile(a, zero_bubble)
    deepspeed, compression = _check_backend(a)
    hf = str(check_hf_directory(a["hf_checkpoint"])) if a["hf_checkpoint"] is not None else None
    litgpt = str(check_litgpt_directory(a["litgpt_checkpoint"])) if a["litgpt_checkpoint"] is not None else None
    if hf is not None and litgpt is not None:
        raise ValueError("Give hf_checkpoint or litgpt_checkpoint, not both: they fill the same weights.")
    if a.get("checkpoint_weights_only") not in (None, True, False):
        raise ValueError(f"`checkpoint_weights_only` must be None, True or False, got {a['checkpoint_weights_only']!r}.")
    stack = a["block_stack"]
    if stack is not None and not isinstance(stack, str):
        raise ValueError(f"LLMParallelStrategy: `block_stack` must be a module name such as 'model.layers', got {stack!r}.")
    norm = a["loss_normalization"]
    if not (callable(norm) or norm in ("mean", "tokens")):
        raise ValueError(
            f"LLMParallelStrategy: `loss_normalization` must be 'mean', 'tokens' or a callable(batch) -> token count,"
            f" got {norm!r}."
        )
    _check_process_group_backend(a["process_group_backend"])
    if a["start_method"] not in get_args(START_METHODS):
        raise ValueError(f"`start_method` must be one of {get_args(START_METHODS)}, got {a['start_method']!r}.")
    if a["tp_plan"] is not None and not isinstance(a["tp_plan"], Mapping):
        raise ValueError(f"`tp_plan` must map module-name patterns to style names, got {type(a['tp_plan']).__name__}.")
    check_plan_entries(a["tp_plan"] or {})
    if a["tp_plan"] and a["tensor_parallel"] == 1:
        raise ValueError(f"LLMParallelStrategy: tp_plan={dict(a['tp_plan'])!r} splits modules over tensor parallelism,"
                         " but tensor_parallel=1. Set tensor_parallel > 1 or remove it.")
    degrees = {k: a[k] for k in ("tensor_parallel", "pipeline_parallel", "data_parallel", "data_parallel_replicate",
                                 "zero_stage", "context_parallel", "expert_parallel")}
    count = None if norm == "mean" else count_target_tokens if norm == "tokens" else norm
    return StrategyOptions(
        degrees=degrees, pipeline=pipeline, backend=a["sharding_backend"], compression=compression, deepspeed=deepspeed,
        hf_checkpoint=hf, litgpt_checkpoint=litgpt, block_stack=stack, pipeline_check=a["pipeline_check"],
        count_tokens=count, context_parallel_mode=a["context_parallel_mode"], fused_optimizer=a["fused_optimizer"],
        sequence_parallel=a["sequence_parallel"], tp_plan=dict(a["tp_plan"] or {}), cpu_offload=a["cpu_offload"],
        expert_capacity_factor=a["expert_capacity_factor"], compile=a["compile"], start_method=a["start_method"],
        loss_parallel=a["loss_parallel"], async_checkpoint=a["async_checkpoint"],
        checkpoint_weights_only=a.get("checkpoint_weights_only"), fault_tolerance=check_fault_tolerance(a),
        diloco=check_data_parallel_sync(a), timeout=process_group_timeout(a["timeout"]),
    )
