"""The processes under LLMParallelStrategy: launch, process group, device mesh, collectives."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import callbacks
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_llmpar.layout import ParallelLayout
from lightning_llmpar.training.eval_logs import evaluation_logs
from lightning_llmpar.training.even_streams import even_out_streams
from lightning_llmpar.training.loaders import check_loader
from lightning_llmpar.training.sync_groups import apply_metric_groups, log_group

__all__ = ["MeshStrategy"]


class MeshStrategy(ParallelStrategy):
    """Processes started by Lightning's launchers (or torchrun / SLURM), one process group, one device mesh built
    from the layout; subclasses say how the layout is built (``_build_layout``)."""

    _start_method: str
    _process_group_backend: str | None
    _timeout: timedelta | None
    _layout: ParallelLayout | None
    _device_mesh: DeviceMesh | None
    _dp_mesh: DeviceMesh | None
    _log_group: Any = None  # what `self.log(sync_dist=True)` reduces over (None: every process)

    def _build_layout(self, world_size: int) -> ParallelLayout:
        raise NotImplementedError

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

    @override
    def _configure_launcher(self) -> None:
        # Validate the degrees against the world size here, at Trainer construction, before any
        # process is launched or any process group is created.
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            # The launcher's world (torchrun, SLURM) against devices x num_nodes first, as Lightning's launcher
            # does when it runs: without it a mismatch trained on another layout than the one printed (hybrid
            # sharding asked over 2 nodes ran as full sharding over 4 ranks), or named the wrong world size.
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
            self._layout = self._build_layout(self.num_nodes * self.num_processes)
            self._warn_tensor_parallel_across_nodes()
            return
        self._layout = self._build_layout(self.num_nodes * self.num_processes)
        self._warn_tensor_parallel_across_nodes()
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def _warn_tensor_parallel_across_nodes(self) -> None:
        # Tensor-parallel ranks are adjacent: a degree the devices per node do not divide puts a group's every-block
        # collectives on the link between nodes (allowed, but rarely meant).
        tp = self.layout.tp
        if self.num_nodes > 1 and self.num_processes % tp:
            rank_zero_warn(f"tensor_parallel={tp} does not divide devices={self.num_processes} per node: some"
                           " tensor-parallel groups span two nodes, and their collectives in every block cross the"
                           " network. Keep tensor_parallel a divisor of the devices per node (pipeline or data"
                           " parallelism across nodes).")

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.lightning_module is not None
        _refuse_weight_averaging(self.lightning_module.trainer)
        reset_seed()
        self.set_world_ranks()
        self._layout = self._build_layout(self.world_size)
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
        self._device_mesh, self._dp_mesh = self.layout.build_mesh(self.root_device.type)
        self._log_group = log_group(self.layout, self._device_mesh)
        assert self.lightning_module is not None
        # Lets `LightningModule.configure_model()` and `self.device_mesh` see the mesh, as in Lightning.
        self.lightning_module._device_mesh = self._device_mesh

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

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

    def _evaluating(self, evaluating: bool) -> None:
        """Evaluation runs whole sequences on every context-parallel rank: logged values and metrics reduce over the
        data-parallel ranks only until it ends (training.sync_groups)."""
        if self._device_mesh is None or self.lightning_module is None or self.layout.cp == 1:
            return
        self._log_group = log_group(self.layout, self._device_mesh, evaluating)
        apply_metric_groups(self.lightning_module, self.layout, self._device_mesh, evaluating)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._evaluating(True)

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._evaluating(False)

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._evaluating(True)

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        self._evaluating(False)

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._evaluating(True)

    @override
    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._evaluating(False)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        # `self.log(sync_dist=True)`: over the ranks that hold different data, not tensor- or pipeline-parallel
        # copies of one batch (training.sync_groups).
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group if group is not None else self._log_group, reduce_op=reduce_op)
        return tensor

    def step_context(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Around a step: what the set-up does before and after it (``Composed.step``: batch checks, token counts)."""
        composed = getattr(self, "_composed", None)
        batch = args[0] if args else next(iter(kwargs.values()), None)
        return composed.step(method, batch) if composed is not None else nullcontext()

    @contextmanager
    def evaluation_logs(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Iterator[None]:
        """Around an evaluation step: its synced means token-weighted over the data-parallel ranks (training.eval_logs),
        counted after the step's own context (the ignore index its loss told)."""
        batch, composed = args[0] if args else None, getattr(self, "_composed", None)
        with (evaluation_logs(self.lightning_module, composed, batch, self._log_group, self.root_device),
              self.step_context(method, args, kwargs)):
            yield

    @override
    def process_dataloader(self, dataloader: object) -> object:
        ranks = self._dp_mesh.size() if self._dp_mesh is not None else 1
        # Runs unlike one process's, or not at all.
        zero = self._layout.zero_stage if self._layout is not None else 0  # (no layout before the launch)
        trainer = getattr(self.lightning_module, "_trainer", None)
        check_loader(dataloader, trainer, ranks, zero)
        # Or hangs: a stream that ends on one rank first (training.even_streams). Prediction without sharded or
        # expert-parallel weights needs no data-parallel peer in its forward, so there each rank predicts all it has.
        alone = (trainer is not None and trainer.predicting and not zero
                 and (self._layout is None or self._layout.ep == 1))
        return dataloader if alone else even_out_streams(dataloader)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        # Every process votes (Lightning's counts the votes against the world size).
        votes = _sync_ddp_if_available(torch.tensor(int(decision), device=self.root_device), reduce_op=ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def _refuse_weight_averaging(trainer: Any) -> None:
    """Lightning's weight-averaging callbacks copy the whole module in their ``setup``, before this strategy shards
    or splits it, then pair the copy's parameters with the module's one by one: a crash after the first epoch
    (a DTensor beside a tensor under ZeRO-3 and tensor parallelism), and under a pipeline the stage's parameters
    paired with the wrong ones. Lightning refuses them with its own sharded strategies (FSDP, DeepSpeed)."""
    kinds = tuple(getattr(callbacks, name) for name in ("StochasticWeightAveraging", "WeightAveraging")
                  if hasattr(callbacks, name))
    found = [type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, kinds)]
    if found:
        raise ValueError(
            f"{found[0]} keeps a whole copy of the module, made before LLMParallelStrategy shards or splits it, and"
            " pairs its parameters with the sharded ones: it cannot average them. Remove the callback, or train"
            " with a strategy that keeps whole models (Lightning's 'ddp'). A callback keeping its own average of"
            " pl_module.named_parameters() (tensors it updates in place, returned by its state_dict) works under"
            " every layout and resumes (docs/fault-tolerance.md, 'State that differs by rank')."
        )
