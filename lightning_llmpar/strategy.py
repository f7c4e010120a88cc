"""LLMParallelStrategy: a thin Lightning adapter over layout -> mesh -> parallelize -> checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_llmpar import checkpoint as ckpt
from lightning_llmpar.activation_checkpoint import ActivationCheckpointing
from lightning_llmpar.clip import clip_grad_norm_
from lightning_llmpar.compression import CompressionConfig
from lightning_llmpar.compression_hooks import GradientCompression, apply_gradient_compression
from lightning_llmpar.data_parallel import no_gradient_sync
from lightning_llmpar.hf_checkpoint import check_hf_directory, load_hf_checkpoint
from lightning_llmpar.litgpt_checkpoint import check_litgpt_directory, load_litgpt_checkpoint
from lightning_llmpar.structure import mark_block_stack
from lightning_llmpar.layout import ZERO_STAGES, ParallelLayout
from lightning_llmpar.loss_normalization import TokenNormalizer, count_target_tokens
from lightning_llmpar.materialize import materialize
from lightning_llmpar.parallelize import ParallelConfig, Parallelized, parallelize
from lightning_llmpar.pipeline_setup import PipelineConfig, build_pipeline
from lightning_llmpar.precision import mesh_precision
from lightning_llmpar.pipeline_step import PipelineRunner
from lightning_llmpar.tensor_parallel import Packing
from lightning_llmpar.ties import find_tied_weights

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LLMParallelStrategy"]

log = logging.getLogger(__name__)

_START_METHOD = Literal["popen", "spawn", "fork", "forkserver"]
_BACKEND = Literal["fsdp2", "deepspeed"]


def _compression_config(value: Any, zero_stage: int, replicate: Any) -> CompressionConfig:
    config = CompressionConfig.from_user(value)
    config.check_layout(zero_stage, hybrid=zero_stage > 0 and replicate not in ("auto", 1))
    return config


def _first_sample(trainer: pl.Trainer) -> Any:
    """One sample of the first training batch, drawn without moving any random state the run will use."""
    try:
        with torch.random.fork_rng(devices=[]):
            loader = trainer.fit_loop._data_source.dataloader()
            batch = next(iter(loader))
    except Exception as err:  # noqa: BLE001 - the check is optional; the first step checks what it can
        log.info("pipeline split not checked before training (no training batch at hand: %s)", err)
        return None

    def first(t: Any) -> Any:
        return t[:1] if isinstance(t, Tensor) and t.dim() > 0 else t

    return torch.utils._pytree.tree_map(first, batch)


def _train_batch_sizes(trainer: pl.Trainer) -> list[tuple[int, int]]:
    """(batch size, size of the epoch's short last batch or 0) of each training DataLoader whose sizes are known."""
    loader = trainer.train_dataloader
    loaders = getattr(loader, "flattened", None) or ([loader] if loader is not None else [])
    sizes = []
    for dl in loaders:
        size, sampler = getattr(dl, "batch_size", None), getattr(dl, "sampler", None)
        try:
            samples = len(sampler)  # type: ignore[arg-type]
        except TypeError:
            continue  # iterable datasets: checked batch by batch
        if isinstance(size, int) and size > 0:
            sizes.append((size, 0 if getattr(dl, "drop_last", False) else samples % size))
    return sizes


def _positive_int(name: str, value: Any, allow_auto: bool = False) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = " or 'auto'" if allow_auto else ""
        raise ValueError(f"LLMParallelStrategy: `{name}` must be a positive integer{extra}, got {value!r}.")


class LLMParallelStrategy(ParallelStrategy):
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
        tp_plan: explicit tensor-parallel plan, module-name pattern -> style, taking precedence over the
            inferred plan (see ``lightning_llmpar.tensor_parallel.TP_STYLES``).
        pipeline_schedule: a ``torch.distributed.pipelining`` schedule name: Interleaved1F1B (default),
            GPipe, 1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV.
        pipeline_microbatches: microbatches per step (default 2 x pipeline_parallel); must divide the batch.
        pipeline_virtual_stages: stages per pipeline rank (default 2 for multi-stage schedules, else 1).
        pipeline_split_points: block indices where stages 1..S-1 start (default: balanced by parameters).
        sharding_backend: 'fsdp2' (default) or 'deepspeed' (data-parallel axis run by a DeepSpeed engine;
            tensor_parallel and pipeline_parallel must be 1).
        deepspeed_config: a DeepSpeed JSON config (path or dict) merged with these options;
            contradictions are refused.
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
        block_stack: qualified name of the nn.ModuleList holding the model's blocks (e.g. 'model.layers'), for
            models where the one found by structure is not it (see docs/model-convention.md).
        pipeline_check: before splitting, run the step on one sample of the first training batch whole and
            stage by stage and refuse a split that computes something else (see docs/model-convention.md).
        litgpt_checkpoint: a LitGPT checkpoint directory (lit_model.pth + model_config.yaml) loaded into the
            LitGPT model inside the LightningModule, each rank reading only its slices.
        start_method: how processes are started when no launcher (torchrun, SLURM) started them.
    """

    strategy_name = "llmpar"

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
        sharding_backend: _BACKEND = "fsdp2",
        deepspeed_config: str | dict[str, Any] | None = None,
        offload_optimizer: str | None = None,
        offload_parameters: str | None = None,
        gradient_compression: str | dict[str, Any] | None = None,
        hf_checkpoint: str | None = None,
        loss_normalization: Literal["mean", "tokens"] | Callable[[Any], int] = "mean",
        block_stack: str | None = None,
        litgpt_checkpoint: str | None = None,
        pipeline_check: bool = True,
        start_method: _START_METHOD = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        _positive_int("tensor_parallel", tensor_parallel)
        _positive_int("pipeline_parallel", pipeline_parallel)
        _positive_int("data_parallel", data_parallel, allow_auto=True)
        if data_parallel_replicate != "num_nodes":
            _positive_int("data_parallel_replicate", data_parallel_replicate, allow_auto=True)
        if zero_stage not in ZERO_STAGES:
            raise ValueError(f"LLMParallelStrategy: `zero_stage` must be one of {ZERO_STAGES}, got {zero_stage!r}.")
        for name, flag in (("sequence_parallel", sequence_parallel), ("cpu_offload", cpu_offload)):
            if not isinstance(flag, bool):
                raise ValueError(f"LLMParallelStrategy: `{name}` must be True or False, got {flag!r}.")
        if pipeline_parallel == 1:
            # Options of a pipeline that does not exist would be silently ignored.
            given = {
                "pipeline_schedule": pipeline_schedule if pipeline_schedule != "Interleaved1F1B" else None,
                "pipeline_microbatches": pipeline_microbatches,
                "pipeline_virtual_stages": pipeline_virtual_stages,
                "pipeline_split_points": pipeline_split_points,
            }
            given = {k: v for k, v in given.items() if v is not None}
            if given:
                raise ValueError(
                    f"LLMParallelStrategy: {', '.join(f'{k}={v!r}' for k, v in given.items())} configure pipeline"
                    " parallelism, but pipeline_parallel=1. Set pipeline_parallel > 1 or remove them."
                )
        self.pipeline = PipelineConfig.validated(
            pipeline_parallel,
            pipeline_schedule,
            pipeline_microbatches,
            pipeline_virtual_stages,
            pipeline_split_points,
            zero_stage,
        )
        if cpu_offload and zero_stage == 0:
            raise ValueError(
                "LLMParallelStrategy: cpu_offload=True needs sharded state to offload; set zero_stage to 1, 2 or 3."
            )
        if sharding_backend not in get_args(_BACKEND):
            raise ValueError(f"`sharding_backend` must be one of {get_args(_BACKEND)}, got {sharding_backend!r}.")
        self._ds_options = {
            "deepspeed_config": deepspeed_config,
            "offload_optimizer": offload_optimizer,
            "offload_parameters": offload_parameters,
            "gradient_compression": gradient_compression,
        }
        compression: CompressionConfig | None = None
        self._compression: GradientCompression | None = None
        if sharding_backend == "fsdp2":
            given = sorted(k for k, v in self._ds_options.items() if v is not None and k != "gradient_compression")
            if given:
                raise ValueError(
                    f"{', '.join(given)} apply to sharding_backend='deepspeed' only. With the default 'fsdp2'"
                    " backend use cpu_offload=True for offloading."
                )
            if gradient_compression is not None:
                compression = _compression_config(gradient_compression, zero_stage, data_parallel_replicate)
        elif gradient_compression is not None and not isinstance(gradient_compression, str):
            raise ValueError(
                f"gradient_compression={gradient_compression!r} configures the 'fsdp2' backend's compressors; with"
                " sharding_backend='deepspeed' use 'onebit_adam' or 'zero_one_adam'."
            )
        self.hf_checkpoint = str(check_hf_directory(hf_checkpoint)) if hf_checkpoint is not None else None
        self.litgpt_checkpoint = str(check_litgpt_directory(litgpt_checkpoint)) if litgpt_checkpoint is not None else None
        if self.hf_checkpoint is not None and self.litgpt_checkpoint is not None:
            raise ValueError("Give hf_checkpoint or litgpt_checkpoint, not both: they fill the same weights.")
        if block_stack is not None and not isinstance(block_stack, str):
            raise ValueError(f"LLMParallelStrategy: `block_stack` must be a module name such as 'model.layers', got {block_stack!r}.")
        self._block_stack = block_stack
        self._pipeline_check = pipeline_check
        if not (callable(loss_normalization) or loss_normalization in ("mean", "tokens")):
            raise ValueError(
                f"LLMParallelStrategy: `loss_normalization` must be 'mean', 'tokens' or a callable(batch) -> token count,"
                f" got {loss_normalization!r}."
            )
        if loss_normalization != "mean" and sharding_backend == "deepspeed":
            raise ValueError(
                "loss_normalization='tokens' rescales gradients before the optimizer step, which the DeepSpeed engine"
                " takes itself; use it with sharding_backend='fsdp2' (the default)."
            )
        self._count_tokens: Callable[[Any], int] | None = (
            None if loss_normalization == "mean" else count_target_tokens if loss_normalization == "tokens"
            else loss_normalization  # type: ignore[assignment]
        )
        self._tokens: TokenNormalizer | None = None
        self._step_tokens = 1
        if start_method not in get_args(_START_METHOD):
            raise ValueError(f"`start_method` must be one of {get_args(_START_METHOD)}, got {start_method!r}.")
        if tp_plan is not None and not isinstance(tp_plan, Mapping):
            raise ValueError(f"`tp_plan` must map module-name patterns to style names, got {type(tp_plan).__name__}.")
        self._degrees = {
            "tensor_parallel": tensor_parallel,
            "pipeline_parallel": pipeline_parallel,
            "data_parallel": data_parallel,
            "data_parallel_replicate": data_parallel_replicate,
            "zero_stage": zero_stage,
        }
        self.parallel_config = ParallelConfig(
            sequence_parallel=sequence_parallel, tp_plan=dict(tp_plan or {}), cpu_offload=cpu_offload,
            gradient_compression=compression,
        )
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._layout: ParallelLayout | None = None
        self._runner: PipelineRunner | None = None
        self._parallelized = Parallelized()
        if sharding_backend == "deepspeed":
            # One strategy for users and for LightningCLI (whose signature it reads from __init__); the
            # DeepSpeed engine hooks live in a subclass this instance becomes.
            from lightning_llmpar.deepspeed_strategy import LLMDeepSpeedStrategy

            self.__class__ = LLMDeepSpeedStrategy
            self._init_backend()
        self._device_mesh: DeviceMesh | None = None
        self._dp_mesh: DeviceMesh | None = None
        self.num_nodes = 1

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # Lightning's own plugins (precision="16-mixed", ...) become their mesh-aware equivalents.
        self._precision_plugin = mesh_precision(precision_plugin)

    # ----------------------------------------------------------------- layout and processes

    def _build_layout(self, world_size: int) -> ParallelLayout:
        degrees = dict(self._degrees)
        if degrees["data_parallel_replicate"] == "num_nodes":
            degrees["data_parallel_replicate"] = self.num_nodes
        layout = ParallelLayout.from_degrees(world_size, **degrees)
        if self._ds_options["gradient_compression"] is not None and layout.dp == 1:
            raise ValueError(
                f"gradient_compression={self._ds_options['gradient_compression']!r} compresses the data-parallel"
                f" gradient sync, but this layout has one data-parallel rank ({layout}). Remove it, or use more"
                " devices for data parallelism."
            )
        return layout

    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            self._layout = self._build_layout(self.num_nodes * self.num_processes)
        return self._layout

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have been initialized.")
        return self._device_mesh

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        # Lightning only syncs `self.log(sync_dist=True)` and adds a DistributedSampler when this is True.
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp_mesh = self._dp_mesh
        assert dp_mesh is not None
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        # Validate the degrees against the world size here, at Trainer construction, before any
        # process is launched or any process group is created.
        self._layout = self._build_layout(self.num_nodes * self.num_processes)
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        if self.layout.pp > 1 and not model.automatic_optimization:
            raise ValueError(
                "pipeline_parallel > 1 runs forward and backward inside the pipeline schedule, so manual optimization"
                f" (automatic_optimization=False in {type(model).__name__}) cannot call manual_backward. Use automatic"
                " optimization, or pipeline_parallel=1."
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._layout = self._build_layout(self.world_size)
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
        self._device_mesh, self._dp_mesh = self.layout.build_mesh(self.root_device.type)
        assert self.lightning_module is not None
        # Lets `LightningModule.configure_model()` and `self.device_mesh` see the mesh, as in Lightning.
        self.lightning_module._device_mesh = self._device_mesh

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ----------------------------------------------------------------- model

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        done = getattr(module, "_llmpar_parallelized", None)
        if done is not None:
            # fit -> validate/test/predict on the same module: it is already split and sharded.
            layout, self._runner, self._parallelized, self._compression = done
            if layout != self.layout:
                raise ValueError(
                    f"This LightningModule was already parallelized as {layout}; it cannot be re-parallelized as"
                    f" {self.layout}. Build a new module, or load a checkpoint into a fresh one."
                )
        else:
            stage_roots: list[torch.nn.Module] = []
            if self._block_stack is not None:
                mark_block_stack(module, self._block_stack)
            self._apply_precision_plan(module)
            if self._count_tokens is not None:
                self._tokens = TokenNormalizer(self._count_tokens, self.layout.tp, self.layout.dp, self.root_device)
            if self.layout.pp > 1:
                policy = self.parallel_config.mp_policy
                param_dtype = policy.param_dtype if policy is not None else None
                self._runner = build_pipeline(
                    module, self.pipeline, self.device_mesh, self.root_device, self._tokens, param_dtype,
                    check=self._split_check(trainer, module),
                )
                stage_roots = list(self._runner.stage_modules.values())
                self._runner.scale_loss = getattr(self.precision_plugin, "scale_loss", None)
            checkpointing = next((c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)), None)
            self._parallelized = parallelize(
                module, self.layout, self.device_mesh, self.parallel_config, stage_roots, checkpointing
            )
            compression = self.parallel_config.gradient_compression
            if compression is not None:
                self._compression = apply_gradient_compression(
                    self._parallelized.fsdp_roots, self.device_mesh, self.layout, compression
                )
            module._llmpar_parallelized = (self.layout, self._runner, self._parallelized, self._compression)
            # Weights built on the meta device get memory now, for this rank's shards only (ties as they stand
            # after sharding: to_empty gives every name its own memory).
            materialize(module, self.root_device, find_tied_weights(module))
            if self.hf_checkpoint is not None:
                load_hf_checkpoint(module, self.hf_checkpoint, self._parallelized.packings, self._aliases())
            if self.litgpt_checkpoint is not None:
                load_litgpt_checkpoint(module, self.litgpt_checkpoint, self._parallelized.packings, self._aliases())
            if self._runner is not None and self._runner.ties is not None:
                self._runner.ties.make_equal()
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            try:
                self.setup_optimizers(trainer)
            except ValueError as err:
                if "empty parameter list" not in str(err) or any(p.requires_grad for p in module.parameters()):
                    raise
                raise ValueError(
                    f"Pipeline rank {self.device_mesh['pp'].get_local_rank()} holds no trainable parameter (its stages"
                    " are frozen), so an optimizer over only the parameters with requires_grad is empty. Build the"
                    " optimizer from all parameters (frozen ones get no gradient and no update), or freeze fewer layers."
                ) from err
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._install_global_clipping()

    def _split_check(self, trainer: pl.Trainer, module: pl.LightningModule) -> Callable[[], Any] | None:
        """The user's training step on one sample of the first training batch, for the pipeline split check."""
        if not self._pipeline_check or trainer.state.fn != TrainerFn.FITTING:
            return None
        batch = _first_sample(trainer)
        if batch is None:
            return None
        return lambda: module.training_step(batch, 0)

    def _apply_precision_plan(self, module: torch.nn.Module) -> None:
        # Module swaps (FP8 linears) come before anything is split or sharded; the FSDP2 mixed-precision
        # policy goes into the sharding step (see lightning_llmpar.precision).
        precision = self.precision_plugin
        if hasattr(precision, "convert_before_parallelism"):
            precision.convert_before_parallelism(module)
        policy = precision.mp_policy() if hasattr(precision, "mp_policy") else None
        self.parallel_config = dataclasses.replace(
            self.parallel_config, mp_policy=policy, always_shard=bool(getattr(precision, "needs_sharding_wrapper", False))
        )

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
        assert self.model is not None
        self.model.to(self.root_device)

    def _install_global_clipping(self) -> None:
        # Lightning clips with torch.nn.utils.clip_grad_norm_, which cannot stack DTensors from different
        # meshes and would clip each shard by its own norm. Every precision plugin funnels through
        # `clip_grad_by_norm`, so routing that one method keeps loss scaling (unscale first) intact.
        precision = self.precision_plugin

        stage_group = self.device_mesh["pp"].get_group() if self.layout.pp > 1 else None
        ties = self._runner.ties if self._runner is not None else None
        device = self.root_device

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float | int) -> None:
            skip = ties.duplicates() if ties is not None else ()
            params = list(precision.main_params(optimizer))
            clip_grad_norm_(params, float(clip_val), stage_group=stage_group, skip=skip, device=device)

        precision.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    def _through_root(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # Route step methods through the root module's __call__ so FSDP2's root hooks (all-gather of the
        # root's own parameters, backward prefetch set-up) fire even if the step never calls `self(...)`.
        assert self.model is not None and self.lightning_module is not None
        return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    def _step(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._runner is None:
            if method == "training_step" and self._tokens is not None:
                self._step_tokens = self._tokens.add(args[0] if args else next(iter(kwargs.values())))
            return self._through_root(method, *args, **kwargs)
        if kwargs:
            args = (*args, *kwargs.values())  # e.g. dataloader_idx
        accumulate = self.lightning_module.trainer.accumulate_grad_batches if method == "training_step" else 1
        return self._runner.run(method, args[0], tuple(args[1:]), accumulate=accumulate)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._step("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step("predict_step", *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._runner is None:
            if self._tokens is not None:  # weigh the mean loss by its tokens; the step divides by their total
                closure_loss = closure_loss * self._step_tokens
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule already ran backward inside training_step (before Lightning's zero_grad), so
        # fire the backward hooks as usual but put the set-aside gradients back instead of autograd.
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._runner.restore_grads()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        tokens = self._tokens
        if tokens is not None:
            step_closure = closure
            accumulate = self.lightning_module.trainer.accumulate_grad_batches

            def closure() -> Any:  # after the last backward of the step, before clipping and the update
                result = step_closure()
                tokens.finish(self.precision_plugin.main_params(optimizer), accumulate)
                return result

        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._compression is not None and self.lightning_module is not None:
            # Logged through the LightningModule so every logger (CSV, W&B, ...) gets them; the values
            # are already summed over ranks, identical everywhere.
            for name, value in self._compression.step_metrics().items():
                self.lightning_module.log(name, value, on_step=True, on_epoch=False, sync_dist=False)
        return output

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._runner is not None:
            # Before the first step: every training batch must split into microbatches; the configured count must
            # divide the regular batch, and an epoch's short last batch needs a count the schedule takes.
            for size, last in _train_batch_sizes(self.lightning_module.trainer):
                if size % self.pipeline.microbatches:
                    raise ValueError(
                        f"Batch size {size} is not divisible by pipeline_microbatches={self.pipeline.microbatches}. Use a"
                        f" batch size that is a multiple of {self.pipeline.microbatches}, or change the microbatches."
                    )
                if last:
                    self._runner.microbatches_for(last, training=True)

    @property
    def pipeline_runner(self) -> PipelineRunner | None:
        return self._runner

    @property
    def packings(self) -> dict[str, Packing]:
        """Fused parameters split per piece under tensor parallelism: name -> layout (see tensor_parallel.packing)."""
        return dict(self._parallelized.packings)

    @property
    def tied_aliases(self) -> dict[str, str]:
        """Copies of tied weights on pipeline stages: local name -> the name one process gives the weight."""
        return self._aliases()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with no_gradient_sync(self._parallelized.fsdp_roots):
            yield None

    # ----------------------------------------------------------------- collectives

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ----------------------------------------------------------------- checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's state dict, sharded (DTensors; only its pipeline stage's entries), as hooks such as
        ``on_save_checkpoint`` see it. Nothing is gathered; ``save_checkpoint`` writes the shards itself."""
        assert self.model is not None
        return get_model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in `load_checkpoint`, where the sharded model is at hand

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in `load_checkpoint`

    def _aliases(self) -> dict[str, str]:
        ties = self._runner.ties if self._runner is not None else None
        return ties.aliases() if ties is not None else {}

    def _raw_optimizers(self) -> list[Optimizer]:
        return [getattr(opt, "_optimizer", opt) for opt in self.optimizers]

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take `storage_options`.")
        path = Path(self.broadcast(str(filepath)))
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta["llmpar_layout"] = str(self.layout)
        # Lightning leaves optimizer state out of weights-only checkpoints (ModelCheckpoint(save_weights_only=True)).
        meta["llmpar_optimizer_state"] = "optimizer_states" in checkpoint
        ckpt.write_atomically(
            path, lambda staging: self._write_checkpoint(staging, meta), is_rank_zero=self.is_global_zero,
            barrier=self.barrier,
        )

    def _write_checkpoint(self, folder: Path, meta: dict[str, Any]) -> None:
        """Write this rank's part of a checkpoint into ``folder`` (the sharding backend's format)."""
        assert self.model is not None
        optimizers = self._raw_optimizers() if meta["llmpar_optimizer_state"] else []
        ckpt.write_distributed(
            folder, self.model, optimizers, meta, is_rank_zero=self.is_global_zero, aliases=self._aliases(),
            packings=self._parallelized.packings,
        )
        if self._compression is not None:  # per-rank: every rank's residuals differ
            self._compression.save(folder, self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None
        module = self.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        meta = ckpt.load_checkpoint(
            path, self.model, self._raw_optimizers() if fitting else [], aliases=self._aliases(),
            packings=self._parallelized.packings, weights_only=weights_only,
            strict=getattr(module, "strict_loading", True),
        )
        if self._compression is not None:
            self._compression.load(path, self.global_rank, self.root_device)
        return meta

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
