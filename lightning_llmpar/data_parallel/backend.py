"""The sharding backend LLMParallelStrategy holds: what wraps the composed model, steps it, clips, saves and loads.

``FSDP2Backend`` (the default) wraps what ``lightning_llmpar.compose`` built on the device mesh (pipeline split,
tensor parallelism, activation checkpointing, FSDP2 sharding, compression) and runs its steps.
``DeepSpeedBackend`` (``lightning_llmpar.data_parallel.deepspeed``) runs the data-parallel axis on a DeepSpeed
engine. The strategy calls the same methods on either; a backend reads the strategy's public Lightning interface
(model, optimizers, precision plugin, collectives) and its own context, and writes none of the strategy's state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_llmpar.callbacks.summary import summarize_whole_model
from lightning_llmpar.checkpointing import dcp as ckpt
from lightning_llmpar.compose import Composed
from lightning_llmpar.data_parallel.replicate import prepare_manual_backward
from lightning_llmpar.fault_tolerance.diloco import OUTER_STATE, keep_outer_settings
from lightning_llmpar.layout import ParallelLayout
from lightning_llmpar.pipeline.check import refuse_manual_optimization
from lightning_llmpar.pipeline.runner import PipelineRunner
from lightning_llmpar.precision.plugins import mesh_precision
from lightning_llmpar.strategies.options import StrategyOptions
from lightning_llmpar.tensor_parallel.grads import reduce_partial_grads
from lightning_llmpar.training.clip import clip_grad_norm_
from lightning_llmpar.training.loss_normalization import refuse_several_manual_optimizers
from lightning_llmpar.training.optimizer import apply_optimizer_kernels, keep_kernels
from lightning_llmpar.training.sync_groups import log_group

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["BackendContext", "ShardingBackend", "FSDP2Backend"]


@dataclass(frozen=True)
class BackendContext:
    """What a backend is given at set-up: the layout, its mesh (and data-parallel sub-mesh), the options, and
    what ``compose`` built (None for a backend that composes nothing itself)."""

    layout: ParallelLayout
    mesh: DeviceMesh
    dp_mesh: DeviceMesh
    options: StrategyOptions
    composed: Composed | None


class ShardingBackend:
    """One interface for the strategy: precision, wrap (``setup``), step (``backward``, ``optimizer_step``),
    clip (inside ``setup``), save and load. State the steps need (pipeline runner, what was parallelized,
    compression) lives here."""

    name = ""
    engine: Any = None

    composes = True  # the strategy runs ``compose`` before ``setup`` (the DeepSpeed engine wraps the model itself)

    def __init__(self, strategy: ParallelStrategy, options: StrategyOptions) -> None:
        self.strategy = strategy
        self.options = options
        self.ctx: BackendContext | None = None

    @property
    def composed(self) -> Composed | None:
        return self.ctx.composed if self.ctx is not None else None

    @property
    def runner(self) -> PipelineRunner | None:
        return self.composed.runner if self.composed is not None else None

    def convert_precision(self, plugin: Precision | None) -> Precision | None:
        return mesh_precision(plugin)

    def check_layout(self, layout: ParallelLayout) -> None:
        """Refuse a layout this backend cannot run (called once the world size is known, before any process)."""
        plugin = self.strategy.precision_plugin
        if layout.tp > 1 and getattr(plugin, "recipe", None) == "rowwise":
            # Rowwise scales are maxima along the matmul's inner dimension, which tensor parallelism splits (a
            # row-split layer's input, a column-split layer's output gradient): torchao takes each rank's own
            # maximum, so the FP8 values differ from one process's (3.9e-5 in the first loss at tp2).
            raise ValueError(
                f"FP8Precision(recipe='rowwise') with tensor_parallel={layout.tp}: rowwise scales would be taken over"
                " each rank's part of the split dimension, not the whole, and the run would differ from one"
                " process's. Use FP8Precision(recipe='tensorwise') (its scales are reduced over the ranks), or"
                " tensor_parallel=1 (data and pipeline parallelism keep rowwise exact)."
            )
        compression = self.options.deepspeed["gradient_compression"]
        if compression is not None and layout.dp == 1:
            raise ValueError(
                f"gradient_compression={compression!r} compresses the data-parallel gradient sync, but this layout has"
                f" one data-parallel rank ({layout}). Remove it, or use more devices for data parallelism."
            )

    def setup(self, trainer: pl.Trainer, ctx: BackendContext) -> None:
        raise NotImplementedError

    def model_to_device(self) -> None:
        assert self.strategy.model is not None
        self.strategy.model.to(self.strategy.root_device)

    def backward(self, loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        return ParallelStrategy.backward(self.strategy, loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_complete_grads() -> Any:
            result = closure()  # the last micro-batch's forward and backward
            if self.ctx is not None and self.ctx.layout.tp > 1:  # before clipping and the step read them (see tensor_parallel.grads)
                reduce_partial_grads(p for group in optimizer.param_groups for p in group["params"])
            return result

        return ParallelStrategy.optimizer_step(self.strategy, optimizer, closure_then_complete_grads, model, **kwargs)

    checkpoint_kind = "dcp"  # the writer kind its checkpoints' manifests record

    def write_checkpoint(self, folder: Path, meta: dict[str, Any]) -> None:
        raise NotImplementedError

    def checkpoint_state(self, folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
        """For a background save: write this rank's small side files into ``folder`` now and return the DCP state
        dict the background write takes (what ``write_checkpoint`` writes, less ``meta``)."""
        raise NotImplementedError(f"the {self.name} backend writes checkpoints synchronously only")

    def load_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        raise NotImplementedError

    def aliases(self) -> dict[str, str]:
        """Copies of tied weights on pipeline stages: local name -> the name one process gives the weight."""
        return self.composed.aliases() if self.composed is not None else {}


class FSDP2Backend(ShardingBackend):
    """Every dimension composed on the device mesh, data parallelism on FSDP2 (ZeRO 0-3, hybrid)."""

    name = "fsdp2"

    def setup(self, trainer: pl.Trainer, ctx: BackendContext) -> None:
        s = self.strategy
        module = s.lightning_module
        assert module is not None and ctx.composed is not None
        self.ctx = ctx
        plugin = s.precision_plugin  # ours converted the module in compose (convert_before_parallelism)
        s.model = module if hasattr(plugin, "convert_before_parallelism") else plugin.convert_module(module)
        self.model_to_device()
        s.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_optimizers(trainer, module)
        s.setup_precision_plugin()
        if ctx.composed.context_parallel is not None:
            ctx.composed.context_parallel.install()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(s.optimizers, s.root_device)
        self._install_global_clipping()
        summarize_whole_model(trainer)  # Lightning's model summary counts every pipeline stage's parameters
        self._weights_in_place()

    def _weights_in_place(self) -> None:
        """What a precision plugin derives from the weights (FP8 scales) follows weights set outside a step."""
        refresh = getattr(self.strategy.precision_plugin, "refresh_weight_scales", None)
        if refresh is not None:
            refresh(self.strategy.lightning_module)

    def _setup_optimizers(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        s = self.strategy
        s.optimizers, s.lr_scheduler_configs = [], []
        try:
            s.setup_optimizers(trainer)
        except ValueError as err:
            if "empty parameter list" not in str(err) or any(p.requires_grad for p in module.parameters()):
                raise
            assert self.ctx is not None
            raise ValueError(
                f"Pipeline rank {self.ctx.mesh['pp'].get_local_rank()} holds no trainable parameter (its stages"
                " are frozen), so an optimizer over only the parameters with requires_grad is empty. Build the"
                " optimizer from all parameters (frozen ones get no gradient and no update), or freeze fewer layers."
            ) from err
        if self.runner is not None:  # configure_optimizers may switch manual optimization on
            refuse_manual_optimization(module)
        if self.composed is not None and self.composed.tokens is not None and not module.automatic_optimization:
            refuse_several_manual_optimizers(s.optimizers)
        apply_optimizer_kernels(s.optimizers, module, fused=self.options.fused_optimizer)

    def _install_global_clipping(self) -> None:
        # Lightning clips with torch.nn.utils.clip_grad_norm_, which cannot stack DTensors from different
        # meshes and would clip each shard by its own norm. Every precision plugin funnels through
        # `clip_grad_by_norm` (and `clip_grad_by_value`), so routing those keeps loss scaling (unscale first) intact.
        s, ctx = self.strategy, self.ctx
        assert ctx is not None
        precision = s.precision_plugin
        stage_group = ctx.mesh["pp"].get_group() if ctx.layout.pp > 1 else None
        ties = self.runner.ties if self.runner is not None else None
        device = s.root_device

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float | int) -> None:
            self.finish_tokens()
            skip = ties.duplicates() if ties is not None else ()
            params = list(precision.main_params(optimizer))
            clip_grad_norm_(params, float(clip_val), stage_group=stage_group, skip=skip, device=device)

        def clip_grad_by_value(optimizer: Optimizer, clip_val: float | int) -> None:
            # One foreach clamp per kind of gradient: under tensor parallelism without FSDP the split weights'
            # are DTensors and the rest plain tensors, which torch's single foreach call refuses to mix.
            self.finish_tokens()
            kinds: dict[Any, list[Tensor]] = {}
            for p in precision.main_params(optimizer):
                if p.grad is not None:
                    kinds.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
            for params in kinds.values():
                torch.nn.utils.clip_grad_value_(params, float(clip_val))

        precision.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
        precision.clip_grad_by_value = clip_grad_by_value  # type: ignore[method-assign]

    def backward(self, loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        s, composed = self.strategy, self.composed
        assert composed is not None
        if self.runner is None:
            if composed.tokens is not None:  # weigh the mean loss by its tokens; the step divides by their total
                loss = loss * composed.tokens.settled()
            if composed.context_parallel is not None and composed.context_parallel.active:
                loss = loss * composed.context_parallel.weight()
            if not s.lightning_module.automatic_optimization:
                prepare_manual_backward(s.model, loss)  # the backward runs inside the step (see data_parallel.replicate)
            return super().backward(loss, optimizer, *args, **kwargs)
        # The schedule already ran backward inside training_step (before Lightning's zero_grad), so
        # fire the backward hooks as usual but put the set-aside gradients back instead of autograd.
        module = s.lightning_module
        assert module is not None
        s.pre_backward(loss)
        loss = s.precision_plugin.pre_backward(loss, module)
        self.runner.restore_grads()
        loss = s.precision_plugin.post_backward(loss, module)
        s.post_backward(loss)
        return loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        s, composed = self.strategy, self.composed
        assert composed is not None and self.ctx is not None
        if composed.tokens is not None:
            step_closure = closure

            def closure() -> Any:  # after the last backward of the step, before clipping and the update
                result = step_closure()
                self.finish_tokens()
                return result

        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if composed.compression is not None and s.lightning_module is not None:
            # Logged through the LightningModule so every logger (CSV, W&B, ...) gets them; the values
            # are already summed over ranks, identical everywhere.
            for name, value in composed.compression.step_metrics().items():
                s.lightning_module.log(name, value, on_step=True, on_epoch=False, sync_dist=False)
        cp = composed.context_parallel
        if cp is not None and s.lightning_module is not None:
            sent, cp.bytes_sent = cp.bytes_sent, 0
            s.lightning_module.log("cp/bytes_sent", float(sent), on_step=True, on_epoch=False, sync_dist=False)
        experts = composed.parallelized.expert_parallel
        if experts is not None and s.lightning_module is not None:
            # Summed over every rank (tensor-parallel ranks route the same tokens; context-parallel ones each route
            # their part of the sequence), so identical everywhere.
            layout = self.ctx.layout
            for name, value in experts.step_metrics(log_group(layout, self.ctx.mesh), layout.tp).items():
                s.lightning_module.log(name, value, on_step=True, on_epoch=False, sync_dist=False)
        return output

    def finish_tokens(self) -> None:
        """Under loss_normalization='tokens', the step's gradients turned into the per-token mean, once: in the
        optimizer step's closure, or first where a step optimized by hand clips before stepping."""
        s, tokens = self.strategy, self.composed.tokens if self.composed is not None else None
        if tokens is not None:
            params = {id(p): p for opt in s.optimizers for p in s.precision_plugin.main_params(opt)}
            module = s.lightning_module
            tokens.finish(params.values(), module.trainer.accumulate_grad_batches, not module.automatic_optimization)

    def _raw_optimizers(self) -> list[Optimizer]:
        return [getattr(opt, "_optimizer", opt) for opt in self.strategy.optimizers]

    def _saved_optimizers(self, meta: dict[str, Any]) -> list[Optimizer]:
        """The optimizers a checkpoint holds: the module's, then DiLoCo's outer one once it has state (its momentum,
        from the first sync on). ``meta`` records which (``OUTER_STATE``: None without DiLoCo)."""
        if not meta["llmpar_optimizer_state"]:
            return []
        outer = getattr(self.strategy, "outer_optimizer", None)
        meta[OUTER_STATE] = None if outer is None else bool(outer.state)
        return self._raw_optimizers() + ([outer] if meta[OUTER_STATE] else [])

    def write_checkpoint(self, folder: Path, meta: dict[str, Any]) -> None:
        s, composed = self.strategy, self.composed
        assert s.model is not None and composed is not None
        optimizers = self._saved_optimizers(meta)
        ckpt.write_distributed(
            folder, s.model, optimizers, meta, is_rank_zero=s.is_global_zero, aliases=self.aliases(),
            packings=composed.parallelized.packings,
        )
        if composed.compression is not None:  # per-rank: every rank's residuals differ
            composed.compression.save(folder, s.global_rank)

    def checkpoint_state(self, folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
        s, composed = self.strategy, self.composed
        assert s.model is not None and composed is not None
        if composed.compression is not None:  # small and per rank: written now, before the background write starts
            composed.compression.save(folder, s.global_rank)
        optimizers = self._saved_optimizers(meta)
        return ckpt._tensor_state(s.model, optimizers, self.aliases(), composed.parallelized.packings)

    def load_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        s, composed = self.strategy, self.composed
        assert s.model is not None and composed is not None
        module = s.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        optimizers = self._raw_optimizers() if fitting else []
        outer = getattr(s, "outer_optimizer", None) if fitting else None
        if outer is not None and ckpt.read_meta(path, weights_only).get(OUTER_STATE):
            optimizers.append(outer)
        with keep_kernels(optimizers):
            meta = ckpt.load_checkpoint(
                path, s.model, optimizers, aliases=self.aliases(), packings=composed.parallelized.packings,
                weights_only=weights_only, strict=getattr(module, "strict_loading", True), verify=False,
            )  # the strategy verified the folder once, on rank 0
        if outer is not None:
            keep_outer_settings(outer)
        if composed.compression is not None:
            composed.compression.load(path, s.global_rank, s.root_device)
        self._weights_in_place()
        return meta
