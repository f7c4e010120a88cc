"""Preemption signals acted on by every rank at one step.

Lightning acts on a signal inside its handler: on SIGTERM each rank joins a broadcast from rank 0, and on SLURM's
requeue signal (``SLURMEnvironment(auto_requeue=True)``) each rank saves a checkpoint, wherever the signal found it.
A scheduler signals a job's ranks some milliseconds apart, so one rank's broadcast meets another rank's training
collective and the job hangs until the process-group timeout (measured at dp2 with SIGTERMs 30 ms apart: the whole
40 s timeout, then gloo errors on both ranks), losing the steps since the last checkpoint.

While fitting, the strategy puts handlers in their place that only note the signal. Before each batch that ends an
optimizer step, the ranks agree (one all-reduce of a flag per signal, on a CPU group) on what any of them noted, and
every rank runs Lightning's own handler at that point: the broadcast meets the broadcast, the requeue's save is
written by every rank at one step, and after a SIGTERM every rank stops when that step ends
(``SIGTERMException``, as Lightning stops), with ``FaultTolerantCheckpoint``'s save of that step first.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.states import TrainerFn

from lightning_llmpar.training.steps import ends_a_step

__all__ = ["DeferredSignals", "PreemptionHooks"]

_Handler = Callable[[int, FrameType | None], Any]


class DeferredSignals:
    """Lightning's handlers for ``signums``, replaced by handlers that note the signal; ``agree`` (a collective)
    returns what any rank noted, ``run`` calls Lightning's handler for it."""

    def __init__(self, signums: list[int]) -> None:
        self._lightning: dict[int, _Handler] = {}
        self._noted: set[int] = set()
        self._group: Any = None
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be set from the main thread: Lightning's stay
        for signum in signums:
            handler = signal.getsignal(signum)
            if callable(handler):
                self._lightning[signum] = handler
                signal.signal(signum, self._note)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # A CPU group: the flags never wait for an accelerator's queue. Every rank builds it at the same hook.
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._noted.add(signum)

    def agree(self) -> list[int]:
        """The signals any rank noted (every rank calls this at the same point)."""
        signums = sorted(self._lightning)
        if not signums:
            return []
        flags = torch.tensor([int(s in self._noted) for s in signums])
        if self._group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        agreed = [s for s, flag in zip(signums, flags.tolist()) if flag]
        self._noted.difference_update(agreed)  # one noted after the flags were read waits for the next agreement
        return agreed

    def run(self, signum: int) -> None:
        self._lightning[signum](signum, None)

    def restore(self) -> None:
        """Lightning's handlers back (the end of fit: what arrives now is Lightning's to handle)."""
        for signum, handler in self._lightning.items():
            if signal.getsignal(signum) == self._note:
                signal.signal(signum, handler)
        self._lightning.clear()


def _signums(trainer: Any) -> list[int]:
    signums = [signal.SIGTERM]
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
        signums.append(environment.requeue_signal)
    return signums


class PreemptionHooks:
    """The strategy's hooks: signals deferred while fitting, agreed on before each batch that ends a step."""

    lightning_module: Any
    saving_in_foreground: Callable[[], AbstractContextManager[None]]
    _signals: DeferredSignals | None = None
    preempted = False  # a SIGTERM was agreed on: this step is the last (FaultTolerantCheckpoint saves it)

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        # Deferred from the moment Lightning registers its handlers (in trainer._run, after set-up and restore):
        # the sanity check and the callbacks' on_train_start (collectives, some of them) come after that.
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None:  # set up outside a Trainer: no handlers of Lightning's to defer
            return
        connector = trainer._signal_connector
        register = type(connector).register_signal_handlers.__get__(connector)

        def register_then_defer() -> None:
            register()
            if trainer.state.fn == TrainerFn.FITTING:  # elsewhere nothing would act on a noted signal
                self._signals, self.preempted = DeferredSignals(_signums(trainer)), False

        connector.register_signal_handlers = register_then_defer  # this trainer's, replaced at each set-up

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if self._signals is None or not ends_a_step(self.lightning_module.trainer):
            return
        for signum in self._signals.agree():
            self.preempted = self.preempted or signum == signal.SIGTERM
            with self.saving_in_foreground():  # a requeue's checkpoint is on disk before the job is requeued
                self._signals.run(signum)

    def _restore_signals(self) -> None:
        if self._signals is not None:
            self._signals.restore()
            self._signals = None

    def on_train_end(self) -> None:
        self._restore_signals()
        super().on_train_end()  # type: ignore[misc]

    def on_exception(self, exception: BaseException) -> None:
        self._restore_signals()
        super().on_exception(exception)  # type: ignore[misc]

    def teardown(self) -> None:
        self._restore_signals()
        super().teardown()  # type: ignore[misc]
