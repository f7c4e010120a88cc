"""One measured training run through Lightning and LLMParallelStrategy, and the planner's prediction for it."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.activation_checkpointing import ActivationCheckpointing
from lightning_llmpar.callbacks.throughput import peak_flops_per_device
from lightning_llmpar.models import GPTModule
from lightning_llmpar.planner import Candidate, cluster_from, model_spec, predict_memory, predict_step_time
from lightning_llmpar.planner.cluster import PRECISIONS
from lightning_llmpar.planner.speed import model_flops_per_token
from lightning_llmpar.precision.plugins import BF16Precision, FP8Precision

__all__ = ["cluster_kind", "predict", "train"]

GiB = 2**30
# The planner's name for each checkpointing setting of the ActivationCheckpointing callback (None: not modelled).
PLANNER_MODE = {"none": "none", "full": "full", "every_k": "every_2", "selective": "selective",
                "selective_matmuls": None, "budget": None}


class _Steps(Callback):
    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self.losses, self._t = device, [], [], 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_train_batch_start(self, *args: Any) -> None:
        self._sync()
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, *args: Any) -> None:
        self._sync()
        self.seconds.append(time.perf_counter() - self._t)
        self.losses.append(float(outputs["loss"]))


class _ReadsGradientsBeforeZeroGrad(Callback):
    """A hook that could read the gradients Lightning zeroes: with it the strategy keeps the previous step's
    gradients through the step, as Lightning alone does (see lightning_llmpar.training.zero_grad)."""

    def on_before_zero_grad(self, trainer: Trainer, module: Any, optimizer: Any) -> None:
        pass


def _checkpointing(mode: str, budget_mb: float | None) -> ActivationCheckpointing | None:
    if mode == "none":
        return None
    if mode == "selective_matmuls":
        return ActivationCheckpointing(mode="selective", save="attention_and_matmuls")
    if mode == "budget":
        return ActivationCheckpointing(mode="budget", budget_mb=budget_mb, save="attention_and_up_projections")
    return ActivationCheckpointing(mode=mode)  # full, every_k (every 2nd block), selective (keep attention)


def cluster_kind(device_name: str) -> str:
    """The planner's preset for a device by its name ('cpu', or what torch.cuda.get_device_name says)."""
    return "cpu" if device_name == "cpu" else "h200" if "H200" in device_name else "h100"


def predict(model: dict[str, int], batch: int, device_name: str, checkpointing: str, compile: bool,
            float8: str | None, holds_previous_grads: bool = False) -> dict[str, Any] | None:
    """The planner's step time, tokens/s, MFU and reserved peak for this run on one device of the kind found."""
    mode = PLANNER_MODE.get(checkpointing)
    if mode is None:
        return None
    spec = model_spec(model)
    kind = cluster_kind(device_name)
    cluster = cluster_from(kind, gpus_per_node=1)
    p = PRECISIONS["fp8" if float8 else "bf16-mixed"]
    c = Candidate(micro_batch=batch, checkpointing=mode, compile=compile, float8=float8,  # type: ignore[arg-type]
                  holds_previous_grads=holds_previous_grads)
    t = predict_step_time(spec, c, model["block_size"], cluster, p)
    m = predict_memory(spec, c, model["block_size"], p, cuda=cluster.caching_allocator)
    return {"cluster": kind, "step_s": t.step, "tokens_per_s": t.tokens_per_s,
            "mfu_bf16_peak": model_flops_per_token(spec, model["block_size"]) * t.tokens_per_s
            / (cluster.peak_tflops * 1e12), "reserved_gib": m.peak / GiB}


def train(model: dict[str, int], *, accelerator: str, steps: int, batch: int, checkpointing: str = "none",
          compile: bool = False, float8: str | None = None, budget_mb: float | None = None,
          holds_previous_grads: bool = False, callbacks: tuple[Callback, ...] = ()) -> dict[str, Any]:
    """Train ``model`` (the example GPT's arguments) for ``steps`` on random tokens; median step time over the
    last two thirds (compilation and autotuning fall in the first), peak memory, MFU against the bf16 peak.
    ``holds_previous_grads``: with a hook before zero_grad, which keeps last step's gradients through the step."""
    seed_everything(0, verbose=False)
    if accelerator == "cuda":
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    module = GPTModule(learning_rate=3e-4, warmup_steps=2, total_steps=steps, **model)
    # Every block's linears in FP8 and the head in bf16, as torchtitan runs Float8 (one device: no FP8 all-gather).
    plugin = (FP8Precision(recipe=float8, float8_all_gather=False, keep_first_last=False, skip=["lm_head"])  # type: ignore[arg-type]
              if float8 else BF16Precision())
    device = torch.device(accelerator)
    steps_cb = _Steps(device)
    hooks: list[Callback] = [steps_cb, *callbacks]  # ``callbacks``: extra ones, e.g. phases.py's recorder
    ac = _checkpointing(checkpointing, budget_mb)
    if ac is not None:
        hooks.append(ac)
    if holds_previous_grads:
        hooks.append(_ReadsGradientsBeforeZeroGrad())
    trainer = Trainer(accelerator=accelerator, devices=1, strategy=LLMParallelStrategy(compile=compile),
                      plugins=[plugin], max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0, callbacks=hooks, use_distributed_sampler=False)
    data = torch.randint(0, model["vocab_size"], (steps * batch, model["block_size"] + 1),
                         generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch, shuffle=False)
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    wall = time.perf_counter() - start
    warm = steps_cb.seconds[steps // 3:] or steps_cb.seconds
    step = sorted(warm)[len(warm) // 2]
    tokens_per_s = batch * model["block_size"] / step
    spec = model_spec(model)
    flops = model_flops_per_token(spec, model["block_size"])
    peak = peak_flops_per_device(device, torch.bfloat16)
    out: dict[str, Any] = {
        "model": model, "parameters": spec.params, "batch": batch, "steps": steps, "checkpointing": checkpointing,
        "compile": compile, "float8": float8, "holds_previous_grads": holds_previous_grads,
        "converted_fp8_linears": len(getattr(plugin, "converted", [])),
        "median_step_s": step, "tokens_per_s": tokens_per_s, "model_tflops_per_s": flops * tokens_per_s / 1e12,
        "mfu_bf16_peak": flops * tokens_per_s / peak if peak else None, "first_step_s": steps_cb.seconds[0],
        "fit_wall_s": wall, "losses_first_last": [steps_cb.losses[0], steps_cb.losses[-1]],
    }
    if ac is not None and getattr(ac, "report", None):
        out["checkpointed_blocks"] = [r["mode"] for r in ac.report]
    if accelerator == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    del trainer, module
    gc.collect()
    return out
