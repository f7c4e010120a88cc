"""Runs that survive killed ranks: complete-only checkpoints, the data position, and step guards.

- ``FaultTolerantCheckpoint`` (a ModelCheckpoint): saves every N steps, keeps the last k, and answers
  ``trainer.fit(ckpt_path="last")`` with the newest checkpoint that is complete and intact, skipping (with a
  warning) any that a crash left half-written. Restarted by torchrun ``--max-restarts`` or a cluster
  requeue, the same command resumes. It stores the data position and restores it into a
  ``ResumableDistributedSampler``, so each sample of the epoch is trained on exactly once.
- ``StepGuard``: a non-finite loss or gradient, or a loss spike, skips the update on every rank alike;
  too many in a row stop the run with a checkpoint. Every N steps it compares replicas by checksum.
"""

from __future__ import annotations

import math
import re
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.tensor import DTensor, Replicate

from lightning_llmpar.checkpointing.dcp import recover
from lightning_llmpar.checkpointing.manifest import LINEAGE_KEY, read_manifest, remove_owned
from lightning_llmpar.checkpointing.scan import checkpoint_problem, legacy_note
from lightning_llmpar.fault_tolerance.position import count_batch, restore_position, resumable_sampler

__all__ = ["FaultTolerantCheckpoint", "StepGuard", "checkpoint_problem", "newest_complete_checkpoint", "recover_folder"]

_STEP = re.compile(r"step[=_-]?(\d+)")
# What FaultTolerantCheckpoint writes (``step=N.ckpt``) and the staging/old folders of its atomic writes.
_OWN = re.compile(r"^step=\d+\.ckpt$")
_OWN_NAMES = re.compile(r"step=\d+\.ckpt")


def _step_of(path: Path) -> int:
    match = _STEP.search(path.name)
    return int(match.group(1)) if match else -1


def recover_folder(folder: Path, names: re.Pattern[str]) -> list[Path]:
    """:func:`recover` every checkpoint of ``folder`` whose name ``names`` matches and that a save interrupted between
    its two renames left only as a complete ``.NAME.partial`` or ``.NAME.old``; returns those put back."""
    restored = []
    for hidden in sorted(folder.glob(".*")) if folder.is_dir() else []:
        for suffix in (".partial", ".old"):
            name = hidden.name[1:].removesuffix(suffix)
            path = folder / name
            if hidden.name.endswith(suffix) and names.fullmatch(name) and not path.exists():
                recover(path)
                if path.exists():
                    restored.append(path)
    return restored


def newest_complete_checkpoint(folder: Path, kind: str | None = None, trusted: bool = False) -> Path | None:
    """The highest-step checkpoint in ``folder`` that passes :func:`checkpoint_problem` (written by a backend of
    checkpoint ``kind`` when given); warns about the others.

    A save interrupted between its two renames is finished first (its complete copy put back under its name).
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return None
    recover_folder(folder, _OWN_NAMES)
    skipped = []
    for path in sorted((p for p in folder.iterdir() if p.name.endswith(".ckpt")), key=_step_of, reverse=True):
        problem = checkpoint_problem(path, kind, trusted)
        if problem is None:
            if skipped:
                rank_zero_warn(f"Resuming from {path}, the newest complete checkpoint: newer ones were skipped ({', '.join(skipped)}).")
            note = legacy_note(path)
            if note is not None:
                rank_zero_warn(note)
            return path
        skipped.append(path.name)
        rank_zero_warn(f"Skipping checkpoint {path}: {problem}.")
    return None


def _lineage_of(path: Path) -> str | None:
    manifest = read_manifest(path)
    return manifest.get("lineage") if manifest is not None else None


class FaultTolerantCheckpoint(ModelCheckpoint):
    """Checkpoint every ``every_n_train_steps`` steps into ``dirpath``, keep the last ``keep_last``.

    Resume with ``trainer.fit(..., ckpt_path="last")``: the newest intact checkpoint is used. Its checkpoints carry
    the run's lineage (kept across resumes); pruning removes only checkpoints of that lineage, and a fresh run into
    a folder holding other checkpoints is refused before its first step. Under ``LLMParallelStrategy`` a SIGTERM
    (a preemption notice) stops every rank at the end of one step, which is saved first (``save_on_preemption``).
    """

    def __init__(
        self, dirpath: str, every_n_train_steps: int = 50, keep_last: int = 3, save_on_preemption: bool = True
    ) -> None:
        if every_n_train_steps < 1 or keep_last < 1:
            raise ValueError(
                f"every_n_train_steps ({every_n_train_steps}) and keep_last ({keep_last}) must be at least 1."
            )
        super().__init__(
            dirpath=dirpath, filename="step={step}", auto_insert_metric_name=False, monitor="step", mode="max",
            save_top_k=-1, every_n_train_steps=every_n_train_steps, save_on_train_epoch_end=False,
            enable_version_counter=False,
        )
        self.keep_last, self.save_on_preemption = keep_last, save_on_preemption
        self.lineage: str | None = None  # this run's id, restored on resume (see load_state_dict)
        self._position: dict[str, int] | None = None

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[LINEAGE_KEY] = self.lineage  # the strategy records it in the checkpoint's manifest

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            self._prune(Path(filepath).parent, getattr(trainer.strategy, "checkpoint_in_flight", None))

    def _prune(self, folder: Path, in_flight: Path | None = None) -> None:
        # By step on disk, not by ModelCheckpoint's in-memory ranking, which a restart does not fully restore;
        # only this run's lineage, only the files its manifests name. Runs after the save's final barrier; a
        # background save still being written (``in_flight``) is a staging folder, never counted or touched.
        saved = sorted((p for p in folder.iterdir() if _OWN.match(p.name) and _lineage_of(p) == self.lineage),
                       key=_step_of, reverse=True)
        for stale in saved[self.keep_last :]:
            remove_owned(stale)

    def _refuse_foreign(self, trainer: Trainer) -> None:
        """A fresh run into a folder holding another run's checkpoints would leave them behind and prune its own."""
        folder = Path(self.dirpath or "")
        foreign: list[str] = []
        if trainer.is_global_zero and trainer.ckpt_path is None and folder.is_dir():
            foreign = sorted((p.name for p in folder.iterdir() if _OWN.match(p.name) and _lineage_of(p) != self.lineage),
                             key=lambda n: _step_of(Path(n)))
        foreign = trainer.strategy.broadcast(foreign)
        if foreign:
            raise ValueError(
                f"FaultTolerantCheckpoint(dirpath={str(folder)!r}) holds checkpoints of another run ({', '.join(foreign[:6])}"
                f"{' ...' if len(foreign) > 6 else ''}) and this run starts fresh. Resume them with"
                " trainer.fit(..., ckpt_path='last'), or give this run another dirpath (or move them away)."
            )

    def _find_last_checkpoints(self, trainer: Trainer) -> set[str]:
        strategy = trainer.strategy  # checkpoint_weights_only=False: what the load will unpickle is trusted
        trusted = getattr(getattr(strategy, "options", None), "checkpoint_weights_only", None) is False
        newest = newest_complete_checkpoint(Path(self.dirpath or ""), getattr(strategy, "checkpoint_kind", None), trusted)
        return {str(newest)} if newest is not None else set()

    # -- data position (shared with DataPosition) -----------------------------------------------------

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int) -> None:
        count_batch(trainer, batch, idx)  # before the save below, which stores the position
        super().on_train_batch_end(trainer, pl_module, outputs, batch, idx)
        # A SIGTERM every rank agreed on (fault_tolerance.preemption): this step is the run's last, so it is saved
        # where a periodic save would be, and the resumed run loses nothing.
        if (self.save_on_preemption and getattr(trainer.strategy, "preempted", False)
                and self._last_global_step_saved != trainer.global_step):
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._refuse_foreign(trainer)  # after the restore (which sets ckpt_path and the lineage), before step one
        restore_position(trainer, self._position)
        self._position = None

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "lineage": self.lineage}
        sampler = resumable_sampler(self._trainer) if getattr(self, "_trainer", None) is not None else None
        if sampler is not None:
            state["data_position"] = sampler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._position = state_dict.pop("data_position", None)
        self.lineage = state_dict.pop("lineage", None) or self.lineage
        super().load_state_dict(state_dict)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        if self.lineage is None:  # one id for all ranks (only rank 0 writes manifests, but all save it)
            self.lineage = trainer.strategy.broadcast(uuid.uuid4().hex)
        super().setup(trainer, pl_module, stage)


class StepGuard(Callback):
    """Skip bad updates consistently on every rank, and check that replicas stay identical.

    A step is bad when the loss or any gradient is not finite, or (with ``spike_factor``) the loss exceeds
    ``spike_factor`` x the mean of the last ``window`` good losses. All ranks agree on the verdict
    (an all-reduce), drop the gradients and skip the update. ``max_consecutive_bad`` bad steps in a row
    save a checkpoint and stop the run. ``check_replicas_every`` > 0 compares parameter checksums across
    the ranks that must hold the same values, and stops the run on a divergence.
    """

    def __init__(
        self,
        spike_factor: float | None = None,
        window: int = 20,
        max_consecutive_bad: int = 5,
        check_replicas_every: int = 0,
        stop_checkpoint: str | None = None,
    ) -> None:
        bad = {name: value for name, value, ok in (
            ("spike_factor", spike_factor, spike_factor is None or (isinstance(spike_factor, (int, float)) and spike_factor > 1)),
            ("window", window, isinstance(window, int) and window >= 1),
            ("max_consecutive_bad", max_consecutive_bad, isinstance(max_consecutive_bad, int) and max_consecutive_bad >= 1),
            ("check_replicas_every", check_replicas_every, isinstance(check_replicas_every, int) and check_replicas_every >= 0),
        ) if not ok or isinstance(value, bool)}
        if bad:
            raise ValueError(f"StepGuard: {', '.join(f'{k}={v!r}' for k, v in bad.items())}: spike_factor must be a number"
                             " above 1 (a loss above that many times the recent mean is a spike) or None, window and"
                             " max_consecutive_bad positive integers, check_replicas_every an integer >= 0 (0: never).")
        self.spike_factor, self.max_bad, self.check_every = spike_factor, max_consecutive_bad, check_replicas_every
        self.recent: deque[float] = deque(maxlen=window)
        self.consecutive_bad = 0
        self.skipped_steps: list[int] = []
        self.stop_checkpoint = stop_checkpoint
        self._loss: float = float("nan")

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if getattr(trainer.strategy, "engine", None) is not None:
            raise ValueError(
                "StepGuard skips a step by dropping gradients, which the DeepSpeed engine keeps in its own"
                " partitions. Use it with sharding_backend='fsdp2' (the default)."
            )
        counted = getattr(getattr(trainer.strategy, "options", None), "count_tokens", None) is not None
        if counted and not pl_module.automatic_optimization:
            raise ValueError(
                "StepGuard judges the loss a backward gets; with manual optimization under loss_normalization='tokens'"
                " that is the rank's own loss weighed by its valid targets (a rank without any: NaN), not the batch's,"
                " so it would skip good steps and miss spikes. Use automatic optimization, or"
                " loss_normalization='mean'."
            )

    @staticmethod
    def _scaler(trainer: Trainer) -> Any:
        return getattr(trainer.precision_plugin, "scaler", None)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        # The global batch's loss where the strategy has it: a rank whose part holds no valid target computes 0/0,
        # a NaN its zero weight under loss_normalization='tokens' leaves out (one process's step is good).
        whole = getattr(trainer.strategy, "batch_loss", None)
        if isinstance(whole, torch.Tensor) and pl_module.automatic_optimization:  # (manual: backward inside the step)
            self._loss = float(whole.detach().float())
            return
        # With loss scaling (FP16) the hook sees the scaled loss; the guard judges the loss itself.
        scaler = self._scaler(trainer)
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
        self._loss = float(loss.detach().float()) / scale * trainer.accumulate_grad_batches

    def _verdict(self, pl_module: LightningModule) -> bool:
        bad = not math.isfinite(self._loss)
        if not bad and self.spike_factor is not None and len(self.recent) >= 3:
            bad = self._loss > self.spike_factor * (sum(self.recent) / len(self.recent))
        # Non-finite gradients under loss scaling are the scaler's business: it skips that step on every rank and
        # backs off the scale, which is normal operation, not a bad step.
        if not bad and self._scaler(pl_module.trainer) is None:
            for p in pl_module.parameters():
                if p.grad is not None:
                    g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    if not torch.isfinite(g).all():
                        bad = True
                        break
        flag = torch.tensor([1.0 if bad else 0.0], device=pl_module.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one rank's bad step is every rank's bad step
        return bool(flag.item())

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if not self._verdict(pl_module):
            self.consecutive_bad = 0
            self.recent.append(self._loss)
            return
        self.consecutive_bad += 1
        self.skipped_steps.append(trainer.global_step)
        for p in pl_module.parameters():
            p.grad = None  # the optimizer skips parameters without gradients: no update, no state change
        pl_module.log("fault/skipped_step", 1.0, rank_zero_only=True)
        rank_zero_warn(f"Step {trainer.global_step}: loss {self._loss:.4g} or a gradient is bad; update skipped on every rank.")
        if self.consecutive_bad >= self.max_bad:
            if self.stop_checkpoint:
                trainer.save_checkpoint(self.stop_checkpoint)
            raise RuntimeError(
                f"{self.consecutive_bad} bad steps in a row (last at step {trainer.global_step}, loss {self._loss:.4g})."
                f" Training stopped{' after saving ' + self.stop_checkpoint if self.stop_checkpoint else ''}."
                " Lower the learning rate, check the data, or raise max_consecutive_bad."
            )

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int) -> None:
        if self.check_every and trainer.global_step % self.check_every == 0 and dist.is_initialized():
            check_replicas(pl_module, trainer.strategy)


def _checksum(t: torch.Tensor) -> torch.Tensor:
    local = (t.to_local() if isinstance(t, DTensor) else t).detach().double()
    return torch.stack([local.sum(), (local * local).sum()])


def check_replicas(module: LightningModule, strategy: Any) -> None:
    """Raise if ranks that must hold identical values (replicated placements) disagree."""
    mesh = strategy.device_mesh
    names = mesh.mesh_dim_names or ()
    for name, p in module.named_parameters():
        axes = [i for i, pl in enumerate(p.placements) if isinstance(pl, Replicate)] if isinstance(p, DTensor) else []
        groups = [p.device_mesh.get_group(i) for i in axes] if isinstance(p, DTensor) else [
            mesh[a].get_group() for a in ("dp_replicate", "dp_shard", "tp") if a in names and mesh[a].size() > 1
        ]
        mine = _checksum(p)
        for group in groups:
            gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, mine, group=group)
            spread = max(float((g - mine).abs().max()) for g in gathered)
            if spread > 1e-6 * (1 + float(mine.abs().max())):
                raise RuntimeError(
                    f"Replicas diverged: parameter '{name}' differs across ranks {dist.get_process_group_ranks(group)}"
                    f" (checksum spread {spread:.3g}). Stopping: resume from the last checkpoint."
                )
