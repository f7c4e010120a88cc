"""Run metrics that stay right under parallelism: tokens/s over data-parallel ranks, FLOPs and MFU per
device (the compute dtype taken from the precision plugin), memory per rank."""

from __future__ import annotations

import math
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lightning_llmpar.callbacks.summary import count_whole_model
from lightning_llmpar.modeling.structure import find_block_stack
from lightning_llmpar.precision.plugins import compute_dtype
from lightning_llmpar.training.batches import batch_tokens, first_tensor
from lightning_llmpar.training.steps import ends_a_step

__all__ = ["ThroughputAndMemory", "model_flops_per_token", "peak_flops_per_device"]


def model_flops_per_token(module: nn.Module, seq_len: int, strategy: Any = None) -> float:
    """Training FLOPs per token of a decoder LM: 6 x (parameters outside input embeddings, a tied head's in) for the
    matmuls forward and backward, plus 12 x layers x width x sequence for attention scores and values.

    Counts the whole model from any rank: DTensor shapes are global (tensor/data sharding), and under
    pipeline parallelism (given the ``strategy``) every stage's parameters, a weight tied across stages once.
    """
    # An embedding a head shares (tied weights) is still the head's matmul: counted where it is a Linear's weight,
    # or, when a pipeline holds the head's copy on another stage, as the embedding counted for both.
    runner = getattr(strategy, "pipeline_runner", None)
    shared = runner.ties.counted_shared() if runner is not None and runner.ties is not None else set()
    linear = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    embedding = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    embedding -= linear | shared
    params = count_whole_model(module, strategy, lambda p: id(p) not in embedding)
    stack = find_block_stack(module)
    width = next((m.embedding_dim for m in module.modules() if isinstance(m, nn.Embedding)), 0)
    layers = stack.total if stack is not None else 0
    return 6.0 * params + 12.0 * layers * width * seq_len


# The SXM H200 names itself plainly "NVIDIA H200", which Lightning's table does not parse; its dense peaks are
# the H100 SXM's (NVIDIA's H200 datasheet). FP8 is listed under int8, as in Lightning's table.
_H200_SXM: dict[torch.dtype, float] = {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.int8: 1978.9e12}


def peak_flops_per_device(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak of one device for ``dtype``; Lightning's table lists FP8 peaks under int8."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        dtype = torch.int8
    if device.type != "cuda":
        return None
    if torch.cuda.get_device_name(device).strip().lower() == "nvidia h200" and dtype in _H200_SXM:
        return _H200_SXM[dtype]
    flops = get_available_flops(device, dtype)
    return float(flops) if flops else None


def _rank_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Peak resident set size of this process (KiB on Linux).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class ThroughputAndMemory(Callback):
    """Log ``perf/tokens_per_sec`` (whole run) and ``memory/rank{r}_mb`` every ``log_every_n_steps``
    optimizer steps (default: the Trainer's ``log_every_n_steps``).

    Lightning's ThroughputMonitor multiplies per-device numbers by the world size, which over-counts
    under tensor parallelism (those ranks share one batch). Here tokens are counted on one rank of each
    data-parallel group and multiplied by the data-parallel degree only.

    Also logs ``perf/tflops_per_device`` (model FLOPs, see :func:`model_flops_per_token`, divided over all
    ``world_size`` devices, so tensor and pipeline ranks each count their share once) and ``perf/mfu``
    against the peak for the precision plugin's compute dtype (``peak_flops`` overrides the table; on CPU
    there is no table and MFU is logged only when ``peak_flops`` is given).
    """

    def __init__(
        self, log_every_n_steps: int | None = None, flops_per_token: float | None = None, peak_flops: float | None = None
    ) -> None:
        # (log_every_n_steps=-1 logged every step; a negative or zero FLOP count logged a negative MFU or none.)
        every = log_every_n_steps
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"ThroughputAndMemory: `log_every_n_steps` must be None or an integer >= 1, got {every!r}.")
        for name, value in (("flops_per_token", flops_per_token), ("peak_flops", peak_flops)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < math.inf):
                raise ValueError(f"ThroughputAndMemory: `{name}` must be None or a positive number, got {value!r}.")
        self.every = log_every_n_steps
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.compute_dtype: torch.dtype | None = None
        self._tokens = 0
        self._start: float | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.compute_dtype = compute_dtype(trainer.precision_plugin)
        if self.peak_flops is None:
            self.peak_flops = peak_flops_per_device(pl_module.device, self.compute_dtype)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._tokens += batch_tokens(batch)
        # Only right after an optimizer step, and every `log_every_n_steps` of them.
        every = self.every or trainer.log_every_n_steps
        if not ends_a_step(trainer) or trainer.global_step % every:
            return
        assert self._start is not None
        elapsed = time.perf_counter() - self._start
        dp = trainer.strategy.distributed_sampler_kwargs.get("num_replicas", 1) if trainer.world_size > 1 else 1
        tokens_per_sec = self._tokens * dp / max(elapsed, 1e-9)
        pl_module.log("perf/tokens_per_sec", tokens_per_sec, rank_zero_only=True)
        if self.flops_per_token is None:
            inputs = first_tensor(batch)
            seq_len = int(inputs.shape[-1]) if inputs is not None and inputs.dim() > 1 else 1
            self.flops_per_token = model_flops_per_token(pl_module, seq_len, trainer.strategy)
        per_device = self.flops_per_token * tokens_per_sec / trainer.world_size
        pl_module.log("perf/tflops_per_device", per_device / 1e12, rank_zero_only=True)
        if self.peak_flops:
            pl_module.log("perf/mfu", per_device / self.peak_flops, rank_zero_only=True)
        memory = torch.tensor([_rank_memory_mb(pl_module.device)], device=pl_module.device)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            gathered = [torch.zeros_like(memory) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, memory)
        else:
            gathered = [memory]
        for rank, value in enumerate(gathered):
            pl_module.log(f"memory/rank{rank}_mb", float(value), rank_zero_only=True)
