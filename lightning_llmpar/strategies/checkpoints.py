"""Checkpoints of LLMParallelStrategy: Lightning's checkpoint hooks over the sharding backend's DCP folders.

Nothing is gathered to one rank: every rank writes its own shards (``checkpointing.dcp``), and loading reshards
into whatever layout the run has now. The hooks through which Lightning would move whole state dicts are no-ops.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.optim import Optimizer
from typing_extensions import override

from lightning_llmpar.checkpointing import dcp as ckpt
from lightning_llmpar.checkpointing.async_save import AsyncSaveHooks
from lightning_llmpar.checkpointing.manifest import LINEAGE_KEY, foreign_files, remove_owned
from lightning_llmpar.checkpointing.rank_state import holding, restore_rank_state, split_rank_state, write_rank_state
from lightning_llmpar.data_parallel.backend import ShardingBackend
from lightning_llmpar.fault_tolerance.callbacks import FaultTolerantCheckpoint, recover_folder
from lightning_llmpar.fault_tolerance.diloco import OUTER_STATE
from lightning_llmpar.fault_tolerance.preemption import PreemptionHooks
from lightning_llmpar.pipeline.stage_state import own_state_reads
from lightning_llmpar.strategies.mesh import MeshStrategy

__all__ = ["CheckpointingStrategy"]


class CheckpointingStrategy(PreemptionHooks, AsyncSaveHooks, MeshStrategy):
    """Lightning's checkpoint hooks for a strategy whose sharding backend (``_backend``) writes and reads them,
    in the background with ``async_checkpoint=True`` (see ``checkpointing.async_save``); preemption signals acted
    on at one step by every rank (``fault_tolerance.preemption``)."""

    _backend: ShardingBackend

    @property
    def checkpoint_kind(self) -> str:
        """The kind of checkpoint the sharding backend writes and reads (``dcp``, ``deepspeed``)."""
        return self._backend.checkpoint_kind

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's state dict, sharded (DTensors; only its pipeline stage's entries), as hooks such as
        ``on_save_checkpoint`` see it. Nothing is gathered; ``save_checkpoint`` writes the shards itself."""
        assert self.model is not None
        with own_state_reads():
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

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take `storage_options`.")
        path = Path(self.broadcast(str(Path(filepath).expanduser())))
        # Lightning leaves optimizer state out of weights-only checkpoints (ModelCheckpoint(save_weights_only=True)).
        meta = {**{k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")},
                "llmpar_layout": str(self.layout), "llmpar_optimizer_state": "optimizer_states" in checkpoint}
        # What differs by rank (a callback's sharded EMA, a stage's own tensors) is also written by every rank.
        own = split_rank_state(meta, world_size=self.world_size, gather=self._gather_objects, holding=holding(self.model))
        kind, lineage, rank = self._backend.checkpoint_kind, checkpoint.get(LINEAGE_KEY), self.global_rank

        def state(staging: Path) -> dict[str, Any]:
            write_rank_state(staging, rank, own)
            return self._backend.checkpoint_state(staging, meta)

        def write(staging: Path) -> None:
            write_rank_state(staging, rank, own)
            self._backend.write_checkpoint(staging, meta)

        if self._save_in_background(path, state, meta, lineage):
            return
        ckpt.write_atomically(  # a path holding files this library did not write is refused on every rank
            path, write, is_rank_zero=self.is_global_zero,
            barrier=self.barrier, broadcast=self.broadcast, kind=kind, lineage=lineage, agree=self.reduce_boolean_decision,
        )

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(Path(checkpoint_path).expanduser())))
        trusted = self.options.checkpoint_weights_only if weights_only is None else weights_only
        verdict = ckpt.verdict(path, self.checkpoint_kind, trusted is False) if self.is_global_zero else (None, None)
        problem, note = self.broadcast(verdict)  # all ranks alike
        if problem is not None:
            raise ValueError(f"Checkpoint {path} cannot be loaded: {problem}.")
        if note is not None:
            rank_zero_warn(note)
        meta = self._backend.load_checkpoint(path, trusted)
        attached = {cb.state_key for cb in self.lightning_module.trainer.callbacks}
        note = restore_rank_state(meta, path, rank=self.global_rank, world_size=self.world_size,
                                  layout=str(self.layout), attached=attached, holds=holding(self.model),
                                  agree=self.reduce_boolean_decision, mesh=self.device_mesh)
        if note is not None:
            rank_zero_warn(note)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        from_another_sync = meta.get("llmpar_optimizer_state", True) and meta.get(OUTER_STATE) is None
        if self.options.diloco is not None and fitting and from_another_sync:
            rank_zero_warn(RESUMED_DILOCO)
        return meta

    def _gather_objects(self, obj: Any) -> list[Any]:
        if self.world_size == 1 or not torch.distributed.is_initialized():
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    @property
    def outer_optimizer(self) -> Optimizer | None:
        """DiLoCo's outer optimizer (``data_parallel_sync='diloco'``), saved and loaded beside the module's."""
        replicas = getattr(self, "_replicas", None)  # LLMParallelStrategy's replica groups (fault_tolerance)
        return None if replicas is None else replicas.outer

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        self._wait_for_saves()  # it may be the one being written
        if self.is_global_zero:  # only the files its manifest names; anything else stays, with a warning
            remove_owned(Path(filepath).expanduser())

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        restored = self.broadcast(_restore_interrupted_lasts(trainer) if self.is_global_zero else [])
        if restored and trainer.ckpt_path is None:
            raise ValueError(
                f"{restored[0]} was missing, with a complete copy beside it left by a save interrupted between its"
                " two renames; it is back in place. This run resumed from nothing (Lightning resolves"
                " ckpt_path='last' before the strategy runs, and found no last checkpoint) and would have replaced it."
                " Run again with ckpt_path='last' to resume from it, or give the callback another dirpath."
            )
        found = self.broadcast(_last_over_foreign_files(trainer) if self.is_global_zero else [])
        if found:
            how, path = found[0]
            raise ValueError(
                f"ModelCheckpoint(save_last={how!r}) would put its last checkpoint at {path}, which holds files this"
                " library did not write (a link deletes them; a save is refused at the first one, after training)."
                " Move them, give the callback another dirpath, or leave enable_version_counter on (a free name is"
                " then taken)."
            )


RESUMED_DILOCO = (
    "Resuming a data_parallel_sync='diloco' run from a checkpoint a run without it saved: DiLoCo's outer optimizer"
    " starts from these weights with no Nesterov momentum. Resume every replica group from the same step's checkpoint."
)


def _last_over_foreign_files(trainer: Any) -> list[tuple[Any, str]]:
    """Where a ModelCheckpoint's ``last`` name holds files this library did not write, with its version counter
    (which would pick a free name) off: save_last="link" deletes whatever the name holds (its own code, not
    through the strategy); a save there is refused, but only at the first save, which may be hours in."""
    found = []
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.save_last and cb.dirpath and not cb._enable_version_counter:
            last = Path(cb.format_checkpoint_name({}, cb.CHECKPOINT_NAME_LAST))
            if not last.is_symlink() and foreign_files(last):
                found.append((cb.save_last, str(last)))
    return found


def _restore_interrupted_lasts(trainer: Any) -> list[str]:
    """Rank 0: put back a ModelCheckpoint's ``last`` checkpoint whose save was killed between its two renames (the
    name missing, a complete ``.NAME.partial`` or ``.NAME.old`` beside it: see checkpointing.dcp). Lightning's own
    scan for ``ckpt_path='last'`` does not see those names; FaultTolerantCheckpoint's does, and puts them back."""
    restored: list[str] = []
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and not isinstance(cb, FaultTolerantCheckpoint) and cb.dirpath:
            last = re.compile(rf"{re.escape(cb.CHECKPOINT_NAME_LAST)}.*{re.escape(cb.FILE_EXTENSION)}")
            restored += map(str, recover_folder(Path(cb.dirpath).expanduser(), last))
    return restored
