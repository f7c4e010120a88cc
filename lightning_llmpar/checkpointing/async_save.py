"""Checkpoint saves that do not stop training, on torch's ``dcp.async_save``.

Training stops only while each rank copies its shards into CPU memory (pinned where there is a GPU, so the copy
runs at full speed; the buffers are kept and reused by every later save). The write itself runs in a background
thread. Its collectives (DCP's plan exchange and the final gather of every rank's write results) run on a gloo
group of their own, created once, so they never interleave with the training collectives on the main thread.

A save counts as done only when it is committed: after DCP's finish step, which gathers the results of every rank
and writes ``.metadata`` on rank 0, rank 0 writes ``meta.pt`` (the Lightning state captured when the save was
asked for) and renames the staging folder into place (``dcp.commit_staging``). Until then the checkpoint exists
only as a hidden ``.<name>.partial`` folder, which resume never reads. At most one save is in flight: a new save
first waits for the previous one. Every rank learns, at the same step, whether a save failed on any rank.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from lightning_llmpar.checkpointing.dcp import META_FILE, commit_staging, prepare_staging, replace_problem, staging_path
from lightning_llmpar.checkpointing.shared import check_shared_folder

__all__ = ["AsyncCheckpointer", "AsyncSaveHooks", "CheckpointWriteError"]


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed (on this rank or another); raised on every rank at the same step."""


def _reusable(stager: DefaultStager) -> bool:
    """Whether ``stager`` can stage again. torch 2.11's DefaultStager closes its state-dict stager at the end of
    every staging (clearing the copy table it needs), so a second save through it fails with ``KeyError: <class
    'type'>``; later versions keep it open, with the pinned CPU buffers cached between saves."""
    table = getattr(getattr(stager, "_state_dict_stager", None), "_deepcopy_dispatch", None)
    return bool(table)


@dataclass
class _Save:
    path: Path
    staging: Path
    done: Future[None]


class AsyncCheckpointer:
    """Background DCP saves, one in flight at a time, committed atomically once every rank has written.

    ``save`` returns once this rank's state is staged; ``poll`` (each training step) and ``wait`` (before the next
    save, at the end of fit) agree across ranks on whether the pending save finished or failed; ``abandon`` (after an
    exception, when peers may be gone) only waits for this rank's write, with no collective.
    """

    def __init__(self, timeout: timedelta | None = None) -> None:
        self._timeout = timeout
        self._write_group: dist.ProcessGroup | None = None
        self._control_group: dist.ProcessGroup | None = None
        self._stager: DefaultStager | None = None
        self._finisher: ThreadPoolExecutor | None = None
        self._pending: _Save | None = None

    @property
    def in_flight(self) -> Path | None:
        """The staging folder of the save being written, if any: nothing may delete it."""
        return self._pending.staging if self._pending is not None else None

    def _start(self) -> None:
        if self._stager is not None and _reusable(self._stager):
            return
        if self._stager is not None:  # torch 2.11 closed it after staging: a fresh one, same options
            self._stager = DefaultStager(self._staging_options)
            return
        if dist.is_initialized():
            # Collective: every rank calls save() for every checkpoint, so they create these in the same order.
            kwargs = {"timeout": self._timeout} if self._timeout is not None else {}
            self._write_group = dist.new_group(backend="gloo", **kwargs)
            self._control_group = dist.new_group(backend="gloo", **kwargs)
        gpu = torch.cuda.is_available()
        # Synchronous staging: the snapshot is complete when save() returns, so the next optimizer step cannot
        # change what is written. Pinning and non-blocking copies need an accelerator.
        self._staging_options = StagingOptions(
            use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=gpu,
        )
        self._stager = DefaultStager(self._staging_options)
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmpar-checkpoint")

    def save(
        self,
        path: Path,
        state: Callable[[Path], dict[str, Any]],
        meta: dict[str, Any],
        *,
        is_rank_zero: bool,
        barrier: Callable[[], None],
        lineage: str | None = None,
        broadcast: Callable[[Any], Any] | None = None,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        """Start saving to ``path``: ``state(staging)`` writes this rank's small side files into the staging folder
        and returns the DCP state dict to write in the background; ``meta`` goes into ``meta.pt`` at commit. With
        ``broadcast`` and ``agree``, a folder some rank cannot see is refused first (``checkpointing.shared``)."""
        self.wait()
        self._start()
        assert self._stager is not None and self._finisher is not None
        staging = prepare_staging(path) if is_rank_zero else staging_path(path)
        barrier()  # the stale staging folder is gone before any rank writes into it
        check_shared_folder(staging, is_rank_zero=is_rank_zero, broadcast=broadcast, agree=agree)
        staging.mkdir(parents=True, exist_ok=True)
        tensors = state(staging)
        meta_bytes = b""
        if is_rank_zero:  # captured now: the loops and callbacks move on while the shards are written
            buffer = io.BytesIO()
            torch.save(meta, buffer)
            meta_bytes = buffer.getvalue()
        upload = dcp.async_save(
            tensors, checkpoint_id=staging, process_group=self._write_group, async_stager=self._stager
        )
        assert isinstance(upload, Future)
        done = self._finisher.submit(_finish, upload, staging, path, meta_bytes if is_rank_zero else None, lineage)
        self._pending = _Save(path, staging, done)

    def _agree(self, flags: list[int]) -> list[int]:
        if self._control_group is None:
            return flags
        tensor = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._control_group)
        return tensor.tolist()

    def poll(self) -> None:
        """Between steps: forget the pending save once every rank finished it; raise on every rank if any failed."""
        pending = self._pending
        if pending is None:
            return
        finished = pending.done.done()
        running, failed = self._agree([int(not finished), int(finished and pending.done.exception() is not None)])
        if failed:
            self._fail(pending)
        if not running:
            self._pending = None

    def wait(self) -> None:
        """Block until the pending save is committed (or failed, which raises on every rank)."""
        pending = self._pending
        if pending is None:
            return
        error = _exception(pending.done)
        (failed,) = self._agree([int(error is not None)])
        self._pending = None
        if failed:
            self._fail(pending)

    def abandon(self) -> None:
        """After an exception: let this rank's write finish (or fail) without any collective; warn on failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            error = _exception(pending.done)
            if error is not None:  # every rank says what went wrong with its own write
                warnings.warn(f"Checkpoint {pending.path} was not saved: {type(error).__name__}: {error}", stacklevel=2)

    def close(self) -> None:
        self.abandon()
        if self._finisher is not None:
            self._finisher.shutdown(wait=True)
        if self._stager is not None:
            self._stager.close()
        self._finisher, self._stager = None, None

    def _fail(self, pending: _Save) -> None:
        self._pending = None
        # Not waited for: when another rank failed, this rank's write may still be running.
        error = _exception(pending.done) if pending.done.done() else None
        where = f"{type(error).__name__}: {error}" if error is not None else "it failed on another rank"
        raise CheckpointWriteError(
            f"Checkpoint {pending.path} was not saved ({where}). The previous checkpoints are untouched; its staging"
            f" folder {pending.staging} holds the incomplete write. Check free space and permissions of"
            f" {pending.path.parent}, then resume from the newest complete checkpoint."
        ) from error


def _exception(future: Future[None]) -> BaseException | None:
    try:
        return future.exception()
    except BaseException as err:  # noqa: BLE001 - a cancelled or interrupted wait is a failed save
        return err


def _finish(upload: Future[Any], staging: Path, path: Path, meta_bytes: bytes | None, lineage: str | None) -> None:
    # upload.result() returns once DCP's finish step ran: on rank 0 that gathered every rank's write results and
    # wrote .metadata, so every rank's shards are on disk; only then is the checkpoint given its name.
    upload.result()
    if meta_bytes is not None:
        (staging / META_FILE).write_bytes(meta_bytes)
        commit_staging(staging, path, kind="dcp", lineage=lineage)


class AsyncSaveHooks:
    """The Lightning hooks of a strategy with ``options.async_checkpoint``: background saves only inside the fit
    loop, whose end (or exception) waits for them; between steps a failed save raises on every rank."""

    options: Any
    _timeout: timedelta | None
    _async_live = False  # inside the fit loop: saves go to the background

    @cached_property
    def _async_saves(self) -> AsyncCheckpointer | None:
        return AsyncCheckpointer(self._timeout) if self.options.async_checkpoint else None

    @property
    def checkpoint_in_flight(self) -> Path | None:
        """The staging folder of a background save still being written (``async_checkpoint=True``), else None."""
        return self._async_saves.in_flight if self._async_saves is not None else None

    def _save_in_background(
        self, path: Path, state: Callable[[Path], dict[str, Any]], meta: dict[str, Any], lineage: str | None = None
    ) -> bool:
        if self._async_saves is None or not self._async_live:
            return False
        strategy: Any = self
        problem = replace_problem(path) if strategy.is_global_zero else None
        problem = strategy.broadcast(problem)
        if problem is not None:  # refused on every rank, as a synchronous save is
            raise ValueError(problem)
        self._async_saves.save(path, state, meta, is_rank_zero=strategy.is_global_zero, barrier=strategy.barrier,
                               lineage=lineage, broadcast=strategy.broadcast, agree=strategy.reduce_boolean_decision)
        return True

    def _wait_for_saves(self) -> None:
        if self._async_saves is not None and self._async_live:
            self._async_saves.wait()

    @contextmanager
    def saving_in_foreground(self) -> Iterator[None]:
        """Saves inside the block are committed when it ends, the one in flight before it starts (every rank)."""
        self._wait_for_saves()
        live, self._async_live = self._async_live, False
        try:
            yield
        finally:
            self._async_live = live

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        self._async_live = self._async_saves is not None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if self._async_saves is not None:
            self._async_saves.poll()

    def on_train_end(self) -> None:
        self._wait_for_saves()  # fit returns with every checkpoint committed
        self._async_live = False
        super().on_train_end()  # type: ignore[misc]

    def on_exception(self, exception: BaseException) -> None:
        self._async_live = False
        if self._async_saves is not None:
            self._async_saves.abandon()  # no collective: a peer may be gone
        super().on_exception(exception)  # type: ignore[misc]

    def teardown(self) -> None:
        self._async_live = False
        if self._async_saves is not None:
            self._async_saves.close()
        super().teardown()  # type: ignore[misc]
