"""The sharding backend LLMParallelStrategy holds: what wraps the model, steps it, clips, saves and loads.

``FSDP2Backend`` (the default) composes every dimension on the device mesh: pipeline split, tensor parallelism,
activation checkpointing, FSDP2 sharding and gradient compression (see ``lightning_llmpar.parallelize``).
``DeepSpeedBackend`` (``lightning_llmpar.data_parallel.deepspeed``) runs the data-parallel axis on a DeepSpeed
engine. The strategy calls the same methods on either; neither changes the strategy's class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer

from lightning_llmpar.activation_checkpointing.policy import ActivationCheckpointing
from lightning_llmpar.checkpointing import dcp as ckpt
from lightning_llmpar.checkpointing.hf import load_hf_checkpoint
from lightning_llmpar.checkpointing.litgpt import load_litgpt_checkpoint
from lightning_llmpar.context_parallel import apply_context_parallel
from lightning_llmpar.data_parallel.compression.hooks import GradientCompression, apply_gradient_compression
from lightning_llmpar.data_parallel.replicate import ManualBackwardRedirection, prepare_manual_backward
from lightning_llmpar.modeling.materialize import materialize
from lightning_llmpar.modeling.structure import mark_block_stack
from lightning_llmpar.modeling.ties import find_tied_weights
from lightning_llmpar.parallelize import Parallelized, parallelize
from lightning_llmpar.pipeline.check import first_sample
from lightning_llmpar.pipeline.runner import PipelineRunner
from lightning_llmpar.pipeline.setup import build_pipeline
from lightning_llmpar.precision.plugins import mesh_precision
from lightning_llmpar.tensor_parallel.grads import reduce_partial_grads
from lightning_llmpar.training.clip import clip_grad_norm_
from lightning_llmpar.training.loss_normalization import TokenNormalizer
from lightning_llmpar.training.optimizer import apply_optimizer_kernels, keep_kernels

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_llmpar.strategies.llm_parallel import LLMParallelStrategy

__all__ = ["ShardingBackend", "FSDP2Backend"]


class ShardingBackend:
    """One interface for the strategy: precision, wrap (``setup``), step (``backward``, ``optimizer_step``),
    clip (inside ``setup``), save and load. State the steps need (pipeline runner, what was parallelized,
    compression) lives here."""

    name = ""
    engine: Any = None

    def __init__(self, strategy: LLMParallelStrategy) -> None:
        self.strategy = strategy
        self.runner: PipelineRunner | None = None
        self.parallelized = Parallelized()
        self.compression: GradientCompression | None = None

    def convert_precision(self, plugin: Precision | None) -> Precision | None:
        return mesh_precision(plugin)

    def setup(self, trainer: pl.Trainer) -> None:
        raise NotImplementedError

    def model_to_device(self) -> None:
        assert self.strategy.model is not None
        self.strategy.model.to(self.strategy.root_device)

    def backward(self, loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        return ParallelStrategy.backward(self.strategy, loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_complete_grads() -> Any:
            result = closure()  # the last micro-batch's forward and backward
            if self.strategy.layout.tp > 1:  # before clipping and the step read them (see tensor_parallel.grads)
                reduce_partial_grads(p for group in optimizer.param_groups for p in group["params"])
            return result

        return ParallelStrategy.optimizer_step(self.strategy, optimizer, closure_then_complete_grads, model, **kwargs)

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
        ties = self.runner.ties if self.runner is not None else None
        return ties.aliases() if ties is not None else {}


class FSDP2Backend(ShardingBackend):
    """Every dimension composed on the device mesh, data parallelism on FSDP2 (ZeRO 0-3, hybrid)."""

    name = "fsdp2"

    def setup(self, trainer: pl.Trainer) -> None:
        s = self.strategy
        module = s.lightning_module
        assert module is not None
        s._forward_redirection = ManualBackwardRedirection()  # manual optimization on DDP (see data_parallel.replicate)
        done = getattr(module, "_llmpar_parallelized", None)
        if done is not None:
            # fit -> validate/test/predict on the same module: it is already split and sharded.
            layout, self.runner, self.parallelized, self.compression = done
            s.context_parallel = getattr(module, "_llmpar_context_parallel", None)
            if layout != s.layout:
                raise ValueError(
                    f"This LightningModule was already parallelized as {layout}; it cannot be re-parallelized as"
                    f" {s.layout}. Build a new module, or load a checkpoint into a fresh one."
                )
        else:
            self._parallelize(trainer, module)
        s.model = s.precision_plugin.convert_module(module)
        self.model_to_device()
        s.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            s._reset_optimizers_and_schedulers()
            try:
                s.setup_optimizers(trainer)
            except ValueError as err:
                if "empty parameter list" not in str(err) or any(p.requires_grad for p in module.parameters()):
                    raise
                raise ValueError(
                    f"Pipeline rank {s.device_mesh['pp'].get_local_rank()} holds no trainable parameter (its stages"
                    " are frozen), so an optimizer over only the parameters with requires_grad is empty. Build the"
                    " optimizer from all parameters (frozen ones get no gradient and no update), or freeze fewer layers."
                ) from err
            apply_optimizer_kernels(s.optimizers, module, fused=s.options.fused_optimizer)
        s.setup_precision_plugin()
        if s.context_parallel is not None:
            s.context_parallel.install()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(s.optimizers, s.root_device)
        self._install_global_clipping()

    def _parallelize(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """The composition, in its order: precision swaps, pipeline split, TP / checkpointing / FSDP2 (see
        ``parallelize``), compression, memory for this rank's shards, pretrained weights."""
        s, options = self.strategy, self.strategy.options
        stage_roots: list[torch.nn.Module] = []
        if options.block_stack is not None:
            mark_block_stack(module, options.block_stack)
        self._apply_precision_plan(module)
        if options.count_tokens is not None:
            # Context-parallel ranks count the same whole batch (each weighs its own part, see context_parallel).
            s._tokens = TokenNormalizer(options.count_tokens, s.layout.tp * s.layout.cp, s.layout.dp, s.root_device)
        if s.layout.cp > 1:
            s.context_parallel = apply_context_parallel(module, s.device_mesh["cp"], options.context_parallel_mode)
            module._llmpar_context_parallel = s.context_parallel
        if s.layout.pp > 1:
            policy = s.parallel_config.mp_policy
            self.runner = build_pipeline(
                module, options.pipeline, s.device_mesh, s.root_device, s._tokens,
                policy.param_dtype if policy is not None else None, check=self._split_check(trainer, module),
            )
            stage_roots = list(self.runner.stage_modules.values())
            self.runner.context_parallel = s.context_parallel
            self.runner.scale_loss = getattr(s.precision_plugin, "scale_loss", None)
        checkpointing = next((c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)), None)
        self.parallelized = parallelize(module, s.layout, s.device_mesh, s.parallel_config, stage_roots, checkpointing)
        compression = s.parallel_config.gradient_compression
        if compression is not None:
            self.compression = apply_gradient_compression(self.parallelized.dp_roots, s.device_mesh, s.layout, compression)
        module._llmpar_parallelized = (s.layout, self.runner, self.parallelized, self.compression)
        # Weights built on the meta device get memory now, for this rank's shards only (ties as they stand
        # after sharding: to_empty gives every name its own memory).
        materialize(module, s.root_device, find_tied_weights(module), self.parallelized.packings)
        if options.hf_checkpoint is not None:
            load_hf_checkpoint(module, options.hf_checkpoint, self.parallelized.packings, self.aliases())
        if options.litgpt_checkpoint is not None:
            load_litgpt_checkpoint(module, options.litgpt_checkpoint, self.parallelized.packings, self.aliases())
        if self.runner is not None and self.runner.ties is not None:
            self.runner.ties.make_equal()

    def _split_check(self, trainer: pl.Trainer, module: pl.LightningModule) -> Callable[[], Any] | None:
        """The user's training step on one sample of the first training batch, for the pipeline split check."""
        if not self.strategy.options.pipeline_check or trainer.state.fn != TrainerFn.FITTING:
            return None
        batch = first_sample(trainer)
        if batch is None:
            return None
        strategy = self.strategy

        def step() -> Any:
            # The user's step runs a few extra times here; ``trainer.strategy.checking_pipeline_split`` lets it
            # skip side effects of its own (counters, files).
            strategy.checking_pipeline_split = True
            try:
                return module.training_step(batch, 0)
            finally:
                strategy.checking_pipeline_split = False

        return step

    def _apply_precision_plan(self, module: torch.nn.Module) -> None:
        # Module swaps (FP8 linears) come before anything is split or sharded; the FSDP2 mixed-precision
        # policy goes into the sharding step (see lightning_llmpar.precision.plugins).
        s = self.strategy
        precision = s.precision_plugin
        if hasattr(precision, "convert_before_parallelism"):
            precision.convert_before_parallelism(module)
        policy = precision.mp_policy() if hasattr(precision, "mp_policy") else None
        plain = policy is None and getattr(precision, "compute_dtype", torch.float32) in (torch.float32, torch.float64)
        s.parallel_config = dataclasses.replace(
            s.parallel_config, mp_policy=policy, always_shard=bool(getattr(precision, "needs_sharding_wrapper", False)),
            plain_precision=plain,
        )

    def _install_global_clipping(self) -> None:
        # Lightning clips with torch.nn.utils.clip_grad_norm_, which cannot stack DTensors from different
        # meshes and would clip each shard by its own norm. Every precision plugin funnels through
        # `clip_grad_by_norm`, so routing that one method keeps loss scaling (unscale first) intact.
        s = self.strategy
        precision = s.precision_plugin
        stage_group = s.device_mesh["pp"].get_group() if s.layout.pp > 1 else None
        ties = self.runner.ties if self.runner is not None else None
        device = s.root_device

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float | int) -> None:
            skip = ties.duplicates() if ties is not None else ()
            params = list(precision.main_params(optimizer))
            clip_grad_norm_(params, float(clip_val), stage_group=stage_group, skip=skip, device=device)

        precision.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    def backward(self, loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        s = self.strategy
        if self.runner is None:
            if s._tokens is not None:  # weigh the mean loss by its tokens; the step divides by their total
                loss = loss * s._step_tokens
            if s.context_parallel is not None and s.context_parallel.active:
                loss = loss * s.context_parallel.loss_weight
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
        s = self.strategy
        tokens = s._tokens
        if tokens is not None:
            step_closure = closure
            accumulate = s.lightning_module.trainer.accumulate_grad_batches

            def closure() -> Any:  # after the last backward of the step, before clipping and the update
                result = step_closure()
                tokens.finish(s.precision_plugin.main_params(optimizer), accumulate)
                return result

        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.compression is not None and s.lightning_module is not None:
            # Logged through the LightningModule so every logger (CSV, W&B, ...) gets them; the values
            # are already summed over ranks, identical everywhere.
            for name, value in self.compression.step_metrics().items():
                s.lightning_module.log(name, value, on_step=True, on_epoch=False, sync_dist=False)
        if s.context_parallel is not None and s.lightning_module is not None:
            sent, s.context_parallel.bytes_sent = s.context_parallel.bytes_sent, 0
            s.lightning_module.log("cp/bytes_sent", float(sent), on_step=True, on_epoch=False, sync_dist=False)
        experts = self.parallelized.expert_parallel
        if experts is not None and s.lightning_module is not None:
            # Summed over every rank (tensor-parallel ranks route the same tokens), so identical everywhere.
            assert s._dp_mesh is not None
            for name, value in experts.step_metrics(s._dp_mesh.get_group(), s.layout.tp * s.layout.cp).items():
                s.lightning_module.log(name, value, on_step=True, on_epoch=False, sync_dist=False)
        return output

    def _raw_optimizers(self) -> list[Optimizer]:
        return [getattr(opt, "_optimizer", opt) for opt in self.strategy.optimizers]

    def write_checkpoint(self, folder: Path, meta: dict[str, Any]) -> None:
        s = self.strategy
        assert s.model is not None
        optimizers = self._raw_optimizers() if meta["llmpar_optimizer_state"] else []
        ckpt.write_distributed(
            folder, s.model, optimizers, meta, is_rank_zero=s.is_global_zero, aliases=self.aliases(),
            packings=self.parallelized.packings,
        )
        if self.compression is not None:  # per-rank: every rank's residuals differ
            self.compression.save(folder, s.global_rank)

    def checkpoint_state(self, folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
        s = self.strategy
        assert s.model is not None
        if self.compression is not None:  # small and per rank: written now, before the background write starts
            self.compression.save(folder, s.global_rank)
        optimizers = self._raw_optimizers() if meta["llmpar_optimizer_state"] else []
        return ckpt._tensor_state(s.model, optimizers, self.aliases(), self.parallelized.packings)

    def load_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        s = self.strategy
        assert s.model is not None
        module = s.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        optimizers = self._raw_optimizers() if fitting else []
        with keep_kernels(optimizers):
            meta = ckpt.load_checkpoint(
                path, s.model, optimizers, aliases=self.aliases(), packings=self.parallelized.packings,
                weights_only=weights_only, strict=getattr(module, "strict_loading", True),
            )
        if self.compression is not None:
            self.compression.load(path, s.global_rank, s.root_device)
        return meta
