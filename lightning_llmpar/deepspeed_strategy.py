"""The DeepSpeed sharding backend behind LLMParallelStrategy(sharding_backend='deepspeed').

Same layout object and mesh as the FSDP2 backend; the data-parallel axis is run by a DeepSpeed
engine (ZeRO 0-3, CPU/NVMe offload). Lightning's own DeepSpeedStrategy refuses to run on CPU; this
one runs on gloo as well as NCCL.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_llmpar.deepspeed_backend import (
    build_deepspeed_config,
    check_deepspeed_layout,
    check_nvme,
    deepspeed_precision,
)
from lightning_llmpar.precision import mesh_precision
from lightning_llmpar.strategy import LLMParallelStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LLMDeepSpeedStrategy", "DS_TAG"]

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


class LLMDeepSpeedStrategy(LLMParallelStrategy):
    """What ``LLMParallelStrategy(sharding_backend="deepspeed", ...)`` becomes at construction."""

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # The engine runs precision itself (fp16 with its loss scaler, bf16, autocast); Lightning's side must not
        # scale or cast again, so the plugin becomes a pass-through that remembers the compute dtype.
        plugin = mesh_precision(precision_plugin)
        self._ds_precision = deepspeed_precision(plugin)
        cast = "fp16" in self._ds_precision or "bf16" in self._ds_precision
        dtype = getattr(plugin, "compute_dtype", torch.float32)
        self._precision_plugin = _EnginePrecision(dtype, cast) if plugin is not None else None

    def _init_backend(self) -> None:
        layout_args = self._degrees
        check_deepspeed_layout(
            layout_args["tensor_parallel"], layout_args["pipeline_parallel"], self.parallel_config.cpu_offload,
            self._ds_options["gradient_compression"],
        )
        check_nvme(self._ds_options["offload_optimizer"], self._ds_options["offload_parameters"])
        # Build once now (without runtime values) so a contradicting user config fails at construction.
        build_deepspeed_config(zero_stage=layout_args["zero_stage"], **self._ds_static())
        self.engine: Any = None

    def _ds_static(self) -> dict[str, Any]:
        opts = self._ds_options
        return {
            "user_config": opts["deepspeed_config"],
            "offload_optimizer": opts["offload_optimizer"],
            "offload_parameters": opts["offload_parameters"],
            "gradient_compression": opts["gradient_compression"],
        }

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        import deepspeed

        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        module.to(self.root_device)
        optimizer = None
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"sharding_backend='deepspeed' drives exactly one optimizer; configure_optimizers returned"
                    f" {len(self.optimizers)}."
                )
            optimizer = self.optimizers[0]
        clip = trainer.gradient_clip_val
        if clip is not None and trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError("DeepSpeed clips by norm only; set gradient_clip_algorithm='norm'.")
        config = build_deepspeed_config(
            zero_stage=self.layout.zero_stage,
            gradient_clipping=float(clip) if clip else None,
            accumulate=trainer.accumulate_grad_batches,
            num_params=sum(p.numel() for p in module.parameters()),
            precision=getattr(self, "_ds_precision", {}),
            **self._ds_static(),
        )
        self.engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=config, dist_init_required=False
        )
        self.model = self.engine
        if optimizer is not None:
            # Lightning's LR schedulers keep driving the torch optimizer's param_groups, which the
            # ZeRO optimizer wraps and reads at every step.
            self.optimizers = [ds_optimizer]
        self.setup_precision_plugin()
        # DeepSpeed clips inside engine.step (config gradient_clipping); Lightning must not clip again.
        self.precision_plugin.clip_grad_by_norm = lambda *args, **kwargs: None  # type: ignore[method-assign]

    @override
    def model_to_device(self) -> None:
        pass  # the engine placed the model

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        module = self.lightning_module
        assert module is not None and self.engine is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # Lightning already divided the loss by accumulate_grad_batches.
        self.engine.backward(closure_loss, scale_wrt_gas=False)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # advances DeepSpeed's micro-step counter; no update before the boundary
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        result = closure()
        self.precision_plugin._after_closure(self.lightning_module, optimizer)
        self.engine.step()
        return result

    @override
    def _write_checkpoint(self, folder: Path, meta: dict[str, Any]) -> None:
        meta = {**meta, "llmpar_backend": "deepspeed"}
        self.engine.save_checkpoint(str(folder), tag=DS_TAG, client_state=meta, save_latest=False)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / DS_TAG).is_dir():
            raise FileNotFoundError(f"{path} is not a DeepSpeed checkpoint written by sharding_backend='deepspeed'.")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = self.engine.load_checkpoint(
            str(path), tag=DS_TAG, load_optimizer_states=fitting, load_lr_scheduler_states=False
        )
        return client_state
