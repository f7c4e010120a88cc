"""The DeepSpeed sharding backend LLMParallelStrategy(sharding_backend='deepspeed') holds.

Same layout object and mesh as the FSDP2 backend; the data-parallel axis is run by a DeepSpeed
engine (ZeRO 0-3, CPU/NVMe offload). Lightning's own DeepSpeedStrategy refuses to run on CPU; this
one runs on gloo as well as NCCL.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer

from lightning_llmpar.activation_checkpointing.policy import ActivationCheckpointing
from lightning_llmpar.compose import fill_weights
from lightning_llmpar.data_parallel.backend import BackendContext, ShardingBackend
from lightning_llmpar.data_parallel.deepspeed_config import (
    build_deepspeed_config,
    check_deepspeed_layout,
    check_nvme,
    deepspeed_precision,
)
from lightning_llmpar.modeling.structure import mark_block_stack
from lightning_llmpar.precision.plugins import mesh_precision
from lightning_llmpar.strategies.options import StrategyOptions
from lightning_llmpar.training.documents import apply_document_masking
from lightning_llmpar.training.steps import ends_a_step

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DeepSpeedBackend", "DS_TAG"]

DS_TAG = "ckpt"  # one tag per checkpoint folder; the folder name carries the step


class _EnginePrecision(Precision):
    """Lightning's side of a DeepSpeed run whose engine does the precision work: report the compute dtype, and
    cast floating inputs to the weights' dtype when the engine holds fp16/bf16 weights."""

    def __init__(self, compute_dtype: torch.dtype, cast_inputs: bool) -> None:
        self.compute_dtype, self.cast_inputs = compute_dtype, cast_inputs

    def convert_input(self, data: Any) -> Any:
        if not self.cast_inputs:
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        return apply_to_collection(data, torch.Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t)


class DeepSpeedBackend(ShardingBackend):
    """The data-parallel axis on a DeepSpeed engine (ZeRO 0-3, CPU/NVMe offload); tensor_parallel and
    pipeline_parallel must be 1. The engine owns precision, clipping and the optimizer step."""

    name = "deepspeed"
    composes = False

    def __init__(self, strategy: ParallelStrategy, options: StrategyOptions) -> None:
        super().__init__(strategy, options)
        degrees = options.degrees
        check_deepspeed_layout(
            degrees["tensor_parallel"], degrees["pipeline_parallel"], options.cpu_offload,
            options.deepspeed["gradient_compression"],
        )
        check_nvme(options.deepspeed["offload_optimizer"], options.deepspeed["offload_parameters"])
        # Build once now (without runtime values) so a contradicting user config fails at construction.
        build_deepspeed_config(zero_stage=degrees["zero_stage"], **self._static())
        self.precision: dict[str, Any] = {}

    def _static(self) -> dict[str, Any]:
        opts = self.options.deepspeed
        return {
            "user_config": opts["deepspeed_config"],
            "offload_optimizer": opts["offload_optimizer"],
            "offload_parameters": opts["offload_parameters"],
            "gradient_compression": opts["gradient_compression"],
        }

    def convert_precision(self, plugin: Precision | None) -> Precision | None:
        # The engine runs precision itself (fp16 with its loss scaler, bf16, autocast); Lightning's side must not
        # scale or cast again, so the plugin becomes a pass-through that remembers the compute dtype.
        plugin = mesh_precision(plugin)
        self.precision = deepspeed_precision(plugin)
        cast = "fp16" in self.precision or "bf16" in self.precision
        dtype = getattr(plugin, "compute_dtype", torch.float32)
        return _EnginePrecision(dtype, cast) if plugin is not None else None

    def setup(self, trainer: pl.Trainer, ctx: BackendContext) -> None:
        import deepspeed

        s = self.strategy
        module = s.lightning_module
        assert module is not None
        self.ctx = ctx
        # The engine takes the whole module, and the strategy's composition does not run: a model built on the meta
        # device gets memory here, pretrained weights are read whole, the named block stack and activation
        # checkpointing are applied here.
        fill_weights(module, self.options, s.root_device)
        if self.options.block_stack is not None:
            mark_block_stack(module, self.options.block_stack)
        checkpointing = next((c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)), None)
        if checkpointing is not None:  # on the whole module, before the engine takes it
            checkpointing.apply(module)
        module.to(s.root_device)
        apply_document_masking(module)  # packed documents in transformers models (see training.documents)
        optimizer = None
        if trainer.state.fn == TrainerFn.FITTING:
            s.optimizers, s.lr_scheduler_configs = [], []
            s.setup_optimizers(trainer)
            if len(s.optimizers) != 1:
                raise ValueError(
                    f"sharding_backend='deepspeed' drives exactly one optimizer; configure_optimizers returned"
                    f" {len(s.optimizers)}."
                )
            optimizer = s.optimizers[0]
            if isinstance(optimizer, _MockOptimizer):  # configure_optimizers returned None
                raise ValueError(
                    "sharding_backend='deepspeed' needs an optimizer: configure_optimizers returned None, and the"
                    " engine's ZeRO optimizer cannot wrap none. Return a torch optimizer, or use"
                    " sharding_backend='fsdp2' (the default), which trains without one as Lightning does."
                )
        clip = trainer.gradient_clip_val
        if clip is not None and trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError("DeepSpeed clips by norm only; set gradient_clip_algorithm='norm'.")
        config = build_deepspeed_config(
            zero_stage=ctx.layout.zero_stage,
            gradient_clipping=float(clip) if clip else None,
            accumulate=trainer.accumulate_grad_batches,
            num_params=sum(p.numel() for p in module.parameters()),
            precision=self.precision,
            **self._static(),
        )
        self.engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=config, dist_init_required=False
        )
        s.model = self.engine
        if optimizer is not None:
            # Lightning's LR schedulers keep driving the torch optimizer's param_groups, which the
            # ZeRO optimizer wraps and reads at every step.
            s.optimizers = [ds_optimizer]
        s.setup_precision_plugin()
        # DeepSpeed clips inside engine.step (config gradient_clipping); Lightning must not clip again.
        s.precision_plugin.clip_grad_by_norm = lambda *args, **kwargs: None  # type: ignore[method-assign]

    def model_to_device(self) -> None:
        pass  # the engine placed the model

    def backward(self, loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        s = self.strategy
        module = s.lightning_module
        assert module is not None and self.engine is not None
        s.pre_backward(loss)
        loss = s.precision_plugin.pre_backward(loss, module)
        if module.automatic_optimization:
            # Lightning decides where a group ends, and steps on an epoch's last batch mid-group: DeepSpeed's own
            # micro-step count put that boundary elsewhere (ZeRO-1/2 stepped without reduced gradients and crashed,
            # ZeRO-0 and offloaded ZeRO-3 stepped on unreduced or stale ones, and every later group was shifted).
            self.engine.set_gradient_accumulation_boundary(ends_a_step(module.trainer))
        # Lightning already divided the loss by accumulate_grad_batches.
        self.engine.backward(loss, scale_wrt_gas=False)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # advances DeepSpeed's micro-step counter; no update before the boundary
        loss = s.precision_plugin.post_backward(loss, module)
        s.post_backward(loss)
        return loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        result = closure()
        self.strategy.precision_plugin._after_closure(self.strategy.lightning_module, optimizer)
        self.engine.step()
        return result

    checkpoint_kind = "deepspeed"

    def write_checkpoint(self, folder: Path, meta: dict[str, Any]) -> None:
        meta = {**meta, "llmpar_backend": "deepspeed"}
        self.engine.save_checkpoint(str(folder), tag=DS_TAG, client_state=meta, save_latest=False)

    def load_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        if weights_only is not False:
            raise ValueError(
                f"{path} is a DeepSpeed checkpoint: DeepSpeed reads it by unpickling (torch.load(weights_only=False)),"
                " which runs any code its files hold. Resume it only if you trust it, with"
                " LLMParallelStrategy(..., checkpoint_weights_only=False) (or strategy.load_checkpoint(path,"
                " weights_only=False)); Lightning 2.6 does not pass trainer.fit(weights_only=...) to this strategy."
            )
        if not (path / DS_TAG).is_dir():
            raise FileNotFoundError(f"{path} is not a DeepSpeed checkpoint written by sharding_backend='deepspeed'.")
        fitting = self.strategy.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = self.engine.load_checkpoint(
            str(path), tag=DS_TAG, load_optimizer_states=fitting, load_lr_scheduler_states=False
        )
        return client_state
