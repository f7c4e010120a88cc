"""LLMParallelStrategy: a thin Lightning adapter over layout -> mesh -> compose -> backend (checkpoints in checkpoints.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_llmpar.activation_checkpointing.policy import ActivationCheckpointing
from lightning_llmpar.compose import Composed, SetupContext, compose, composed_before
from lightning_llmpar.context_parallel import ContextParallel
from lightning_llmpar.data_parallel.backend import BackendContext, FSDP2Backend, ShardingBackend
from lightning_llmpar.data_parallel.deepspeed import DeepSpeedBackend
from lightning_llmpar.data_parallel.fsdp import no_gradient_sync
from lightning_llmpar.data_parallel.replicate import ManualBackwardRedirection
from lightning_llmpar.fault_tolerance.replica_groups import ReplicaGroups
from lightning_llmpar.layout import ParallelLayout
from lightning_llmpar.pipeline.check import refuse_manual_optimization, step_on_one_sample
from lightning_llmpar.pipeline.runner import PipelineRunner
from lightning_llmpar.pipeline.setup import start_training
from lightning_llmpar.precision.plugins import mesh_precision
from lightning_llmpar.strategies.checkpoints import CheckpointingStrategy
from lightning_llmpar.strategies.options import BACKENDS, START_METHODS, validate_options
from lightning_llmpar.tensor_parallel import Packing
from lightning_llmpar.tensor_parallel.loss_parallel import LossParallel, split_backward, split_logits
from lightning_llmpar.training.batches import train_batch_sizes
from lightning_llmpar.training.logged_loss import captured_logs, replay_logs, step_loss, step_returns, true_loss
from lightning_llmpar.training.zero_grad import release_unread_grads, zero_grad_follows

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LLMParallelStrategy"]

class LLMParallelStrategy(CheckpointingStrategy):
    """Tensor, data (ZeRO 0-3, hybrid) and sequence parallelism for any LightningModule on one device mesh.

    Args:
        tensor_parallel: ranks that split every weight matrix (Megatron column/row).
        data_parallel: data-parallel ranks; 'auto' = world size / (tensor_parallel x pipeline_parallel).
        pipeline_parallel: pipeline stages (1 = no pipeline).
        zero_stage: 0 replicated (DDP), 1 optimizer state sharded, 2 + gradients, 3 + parameters (FSDP).
        data_parallel_replicate: replicas for hybrid sharding: parameters are sharded over
            data_parallel / data_parallel_replicate ranks and replicated across replicas. 'auto' = 1 for
            zero_stage >= 1 (full sharding) and data_parallel for zero_stage 0; 'num_nodes' shards within a
            node and replicates across nodes.
        sequence_parallel: with tensor_parallel > 1, shard activations along the sequence between the
            tensor-parallel regions (norms, residuals), saving activation memory at no extra traffic.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory (zero_stage >= 1).
        tp_plan: explicit tensor-parallel plan, module-name pattern -> style, over the inferred one (``TP_STYLES``).
        pipeline_schedule: a ``torch.distributed.pipelining`` schedule name: Interleaved1F1B (default),
            GPipe, 1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV.
        pipeline_microbatches: microbatches per step (default 2 x pipeline_parallel); must divide the batch.
        pipeline_virtual_stages: stages per pipeline rank (default 2 for multi-stage schedules, else 1).
        pipeline_split_points: block indices where stages 1..S-1 start (default: balanced by parameters).
        sharding_backend: 'fsdp2' (default) or 'deepspeed' (data-parallel axis run by a DeepSpeed engine;
            tensor_parallel and pipeline_parallel must be 1).
        deepspeed_config: a DeepSpeed JSON config (path or dict) merged with these options; contradictions refused.
        offload_optimizer: DeepSpeed only: 'cpu' or an NVMe directory for optimizer state (zero_stage >= 1).
        offload_parameters: DeepSpeed only: 'cpu' or an NVMe directory for parameters (zero_stage 3).
        gradient_compression: compress the data-parallel gradient sync: 'fp16', 'bf16', 'int8', 'topk',
            'powersgd', or a dict such as ``{"method": "powersgd", "rank": 4, "start_step": 10}`` (see
            docs/compression.md). With sharding_backend='deepspeed': 'onebit_adam' or 'zero_one_adam'.
        hf_checkpoint: a local Hugging Face model directory (config.json + safetensors) loaded into the
            transformers model inside the LightningModule after parallelization, each rank reading only
            the slices it holds. Build the module on the meta device (``trainer.init_module(empty_init=True)``
            or in ``configure_model``) so no rank ever holds the whole model (see docs/huggingface.md).
        loss_normalization: 'mean' (default, as DDP/FSDP): every microbatch's and data-parallel rank's mean
            loss weighs the same. 'tokens': the step's loss is the mean over all valid target tokens (padding
            and ignore_index -100 left out), exactly as one process computes it on the global batch; tokens
            are counted in a dict's 'labels' (shifted by one, as transformers' causal-LM loss) or the targets
            of an (inputs, targets) pair, or by a callable(batch) -> count given here.
        block_stack: qualified name of the ModuleList, ModuleDict or Sequential holding the model's blocks (e.g.
            'model.layers'), for models where the one found by structure is not it (see docs/model-convention.md).
        pipeline_check: before splitting, run the step on one sample of the first training batch whole and
            stage by stage and refuse a split that computes something else (see docs/model-convention.md).
        litgpt_checkpoint: a LitGPT checkpoint directory (lit_model.pth + model_config.yaml) loaded into the
            LitGPT model inside the LightningModule, each rank reading only its slices.
        context_parallel: ranks that each hold part of every sequence (long contexts): batches are cut along
            the sequence and causal SDPA attention runs over the ranks (see docs/context-parallel.md).
        context_parallel_mode: 'ring' (default; torch's ring attention, head-tail load balanced) or 'ulysses'
            (all-to-all from sequence to head shards; heads must divide by context_parallel).
        expert_parallel: data-parallel ranks that split every MoE layer's experts; tokens travel to their
            experts with all-to-all (see docs/expert-parallel.md).
        expert_capacity_factor: each expert takes at most this multiple of its even share of a rank's tokens;
            the rest are dropped (logged as moe/dropped_tokens). None (default): no token is dropped.
        loss_parallel: 'auto' (default), True or False: the LM head's logits split by vocabulary (docs/loss-parallel.md).
        compile: ``torch.compile`` each block of the model's block stack (in place, per block, as torchtitan).
        fused_optimizer: step Adam/AdamW with torch's fused kernel where the optimizer left the choice to torch.
        async_checkpoint: write checkpoints saved during fit in the background (see docs/fault-tolerance.md).
        fault_tolerance: 'torchft': this job is one replica group of several that survive each other's failures
            (per-step quorum, average over live groups, healing from a peer; see docs/fault-tolerance.md).
        data_parallel_sync: 'every_step' (default) or 'diloco': with fault_tolerance='torchft', replica groups step
            on their own and average their weights' progress every ``diloco_every`` steps (default 50) through an
            outer SGD (``diloco_outer_lr``, default 0.7; Nesterov ``diloco_outer_momentum``, default 0.9).
        start_method: how processes are started when no launcher (torchrun, SLURM) started them.
        checkpoint_weights_only: False trusts checkpoints: plain unpickling, DeepSpeed's (docs/fault-tolerance.md).
    """

    strategy_name = "llmpar"
    applies_activation_checkpointing = True  # between tensor parallelism and sharding (see parallelize), or the engine
    checking_pipeline_split = False  # True while the step runs for the pipeline split check (see pipeline.check)

    def __init__(
        self,
        tensor_parallel: int = 1,
        data_parallel: int | Literal["auto"] = "auto",
        pipeline_parallel: int = 1,
        zero_stage: int = 0,
        data_parallel_replicate: int | Literal["auto", "num_nodes"] = "auto",
        sequence_parallel: bool = True,
        cpu_offload: bool = False,
        tp_plan: dict[str, str] | None = None,
        pipeline_schedule: str = "Interleaved1F1B",
        pipeline_microbatches: int | None = None,
        pipeline_virtual_stages: int | None = None,
        pipeline_split_points: list[int] | None = None,
        sharding_backend: BACKENDS = "fsdp2",
        deepspeed_config: str | dict[str, Any] | None = None,
        offload_optimizer: str | None = None,
        offload_parameters: str | None = None,
        gradient_compression: str | dict[str, Any] | None = None,
        hf_checkpoint: str | None = None,
        loss_normalization: Literal["mean", "tokens"] | Callable[[Any], int] = "mean",
        block_stack: str | None = None,
        litgpt_checkpoint: str | None = None,
        pipeline_check: bool = True,
        context_parallel: int = 1,
        context_parallel_mode: Literal["ring", "ulysses"] = "ring",
        expert_parallel: int = 1,
        expert_capacity_factor: float | None = None,
        loss_parallel: bool | Literal["auto"] = "auto",
        compile: bool = False,
        fused_optimizer: bool = True,
        async_checkpoint: bool = False,
        fault_tolerance: Literal["torchft"] | None = None,
        data_parallel_sync: Literal["every_step", "diloco"] = "every_step",
        diloco_every: int | None = None,
        diloco_outer_lr: float = 0.7,
        diloco_outer_momentum: float = 0.9,
        start_method: START_METHODS = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        checkpoint_weights_only: bool | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        # Every argument is checked once, here, into one frozen object; nothing below changes it.
        self.options = options = validate_options(arguments)
        self.pipeline = options.pipeline
        self.hf_checkpoint, self.litgpt_checkpoint = options.hf_checkpoint, options.litgpt_checkpoint
        self._composed: Composed | None = None  # what compose built at set-up
        self._start_method, self._process_group_backend, self._timeout = start_method, process_group_backend, options.timeout
        self._layout, self._device_mesh, self._dp_mesh = None, None, None
        self.num_nodes = 1
        self._replicas: ReplicaGroups | None = None  # fault_tolerance="torchft": this job is one replica group
        self.batch_loss: Tensor | None = None  # the last training step's loss of the global batch, as logged
        # The sharding backend is an object this strategy holds; the precision plugin given so far is converted
        # again for it (the DeepSpeed engine runs precision itself).
        backend = DeepSpeedBackend if sharding_backend == "deepspeed" else FSDP2Backend
        self._backend: ShardingBackend = backend(self, options)
        self.precision_plugin = self._given_precision

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # Lightning's own plugins (precision="16-mixed", ...) become their mesh-aware equivalents, or what the
        # sharding backend runs (Lightning sets the plugin after construction, ParallelStrategy during it).
        self._given_precision = precision_plugin
        backend = self.__dict__.get("_backend")
        self._precision_plugin = backend.convert_precision(precision_plugin) if backend else mesh_precision(precision_plugin)

    # ----------------------------------------------------------------- layout and processes

    def _degrees(self, world_size: int) -> dict[str, Any]:
        """The degrees this run is built with (a preset may derive some from the world size)."""
        return dict(self.options.degrees)

    def _build_layout(self, world_size: int) -> ParallelLayout:
        degrees = self._degrees(world_size)
        if degrees["data_parallel_replicate"] == "num_nodes":
            degrees["data_parallel_replicate"] = self.num_nodes
        layout = ParallelLayout.from_degrees(world_size, **degrees)
        self._backend.check_layout(layout)
        return layout

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if (dp_mesh := self._dp_mesh) is None:
            raise RuntimeError("Data-parallel size and rank exist once fit sets processes up: use them in *_dataloader hooks.")
        kwargs = {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}
        return kwargs if self._replicas is None else self._replicas.sampler_kwargs(kwargs)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        if self.layout.pp > 1:
            refuse_manual_optimization(model)

    # ----------------------------------------------------------------- model

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Compose every dimension on the module (``lightning_llmpar.compose``), then let the backend wrap it."""
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self._forward_redirection = ManualBackwardRedirection()  # manual optimization on DDP (see data_parallel.replicate)
        if self._backend.composes:
            ctx, fitting = self._setup_context(trainer), trainer.state.fn == TrainerFn.FITTING
            self._composed = composed_before(module, ctx, fitting) or compose(module, self._with_split_check(ctx, trainer))
        assert self._dp_mesh is not None
        self._backend.setup(trainer, BackendContext(self.layout, self.device_mesh, self._dp_mesh, self.options, self._composed))
        if self.options.fault_tolerance == "torchft":
            self._replicas = ReplicaGroups(self, trainer, self._timeout or default_pg_timeout, self.options.diloco)

    def _setup_context(self, trainer: pl.Trainer) -> SetupContext:
        checkpointing = next((c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)), None)
        return SetupContext(self.layout, self.device_mesh, self.options, self.root_device, self.precision_plugin,
                            checkpointing)

    def _with_split_check(self, ctx: SetupContext, trainer: pl.Trainer) -> SetupContext:
        # Only for a module composed now: the check reads the first training batch.
        if self.layout.pp == 1 or not self.options.pipeline_check or trainer.state.fn != TrainerFn.FITTING:
            return ctx
        return dataclasses.replace(ctx, split_check=step_on_one_sample(trainer, self))

    @property
    def loss_parallel_heads(self) -> LossParallel | None:
        """The LM heads whose logits stay split over the vocabulary in training steps (None without)."""
        return self._composed.parallelized.loss_parallel if self._composed is not None else None

    @property
    def context_parallel(self) -> ContextParallel | None:
        """Context parallelism as composed (None without it or before set-up)."""
        return self._composed.context_parallel if self._composed is not None else None

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Meta device: real memory is allocated after parallelization, for each rank's shards only. When
        # Lightning lets the strategy decide (configure_model) and weights come from hf_checkpoint, meta too.
        meta = empty_init or (empty_init is None and (self.hf_checkpoint or self.litgpt_checkpoint) is not None)
        with torch.device("meta") if meta else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def model_to_device(self) -> None:
        self._backend.model_to_device()

    def _through_root(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # Through the root's __call__: FSDP2's root hooks (all-gather, prefetch) fire even if the step never calls it.
        assert self.model is not None and self.lightning_module is not None
        return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    def _step(self, method: str, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer
        # Last step's gradients, which Lightning discards after the step, released first (DeepSpeed keeps its own).
        if method == "training_step" and self.engine is None and zero_grad_follows(trainer):
            release_unread_grads(trainer)
        if self._runner is None:
            if self.context_parallel is not None:
                training = method == "training_step" and not self.checking_pipeline_split
                return self.context_parallel.run(training, self._through_root, method, args, kwargs)
            return self._through_root(method, *args, **kwargs)
        if kwargs:
            args = (*args, *kwargs.values())  # e.g. dataloader_idx
        accumulate = trainer.accumulate_grad_batches if method == "training_step" else 1
        return self._runner.run(method, args[0], tuple(args[1:]), accumulate=accumulate)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with (
            self.step_context("training_step", args, kwargs),  # outermost: modes the step opens close first
            self.precision_plugin.train_step_context(),
            captured_logs(self.lightning_module) as logged, step_returns(self.lightning_module, "training_step") as returned,
            split_logits(self.loss_parallel_heads, self.layout.tp) as done,
        ):
            output = done(self._step("training_step", *args, **kwargs))
        loss = step_loss(output, returned if self._runner is None else None)
        tokens = self._composed.tokens if self._composed is not None else None
        true = true_loss(self.layout, self._runner, self.context_parallel, tokens, loss)
        self.batch_loss = true if true is not None else loss
        replay_logs(self.lightning_module, logged, loss, true)  # the global batch's loss (see training.logged_loss)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context(), self.evaluation_logs("validation_step", args, kwargs):
            return self._step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context(), self.evaluation_logs("test_step", args, kwargs):
            return self._step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step("predict_step", *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        with split_backward(self.loss_parallel_heads, closure_loss):  # a reentrant checkpoint reruns on split logits
            return self._backend.backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._replicas is not None:
            closure = self._replicas.averaging(closure, optimizer)
        return self._backend.optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def teardown(self) -> None:
        if self.context_parallel is not None:
            self.context_parallel.teardown()
        if self._replicas is not None:
            self._replicas.shutdown()
            self._replicas = None
        super().teardown()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._replicas is not None:
            self._replicas.on_train_start()
        if self._runner is not None:
            start_training(self._runner, self.pipeline, train_batch_sizes(self.lightning_module.trainer))

    @property
    def pipeline_runner(self) -> PipelineRunner | None:
        return self._backend.runner

    _runner = pipeline_runner

    @property
    def engine(self) -> Any:
        """The DeepSpeed engine with sharding_backend='deepspeed' (after setup), else None."""
        return self._backend.engine

    @property
    def sharding_backend(self) -> ShardingBackend:
        return self._backend

    @property
    def packings(self) -> dict[str, Packing]:
        """Fused parameters split per piece under tensor parallelism: name -> layout (see tensor_parallel.packing)."""
        return dict(self._composed.parallelized.packings) if self._composed is not None else {}

    @property
    def tied_aliases(self) -> dict[str, str]:
        """Copies of tied weights on pipeline stages: local name -> the name one process gives the weight."""
        return self._backend.aliases()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        deferring = self._runner.deferring_reduction() if self._runner else nullcontext()
        roots = self._composed.parallelized.dp_roots if self._composed is not None else []
        with no_gradient_sync(roots), deferring:
            yield None
