"""Run a function on N real ranks on this machine and collect what each rank returns.

The one launcher of the package: ``llmpar verify``, the tests and the benchmarks all start their ranks here.

Workers come from a forkserver that has already imported torch and Lightning, so a rank starts in
a fraction of a second and never inherits an OpenMP pool from the test process (which can hang a fork).
A launch whose rank crashes natively runs once more (see run_ranks).
No rank exits before every rank has reported: a rank still tearing down its process groups when a peer's
sockets close can be aborted by gloo's background thread, losing its result.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import io
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["NativeCrash", "free_port", "preload", "run_ranks"]

_CTX = mp.get_context("forkserver")
_PRELOAD = ["torch", "lightning", "torchmetrics", "lightning_llmpar"]
_CTX.set_forkserver_preload(_PRELOAD)


def preload(*modules: str) -> None:
    """Import ``modules`` in the forkserver too (before its first launch), so ranks start with them loaded."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    _CTX.set_forkserver_preload(_PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, kwargs: dict, queue: Any, done: Any,
    crash_log: str, threads: int,
) -> None:
    # A native abort (SIGABRT, SIGSEGV) writes where each thread was to a file the launcher reads back into its error,
    # as does SIGUSR1, which the launcher sends a rank still running when a peer died. A rank's stderr is captured by
    # whichever test started the forkserver, not by the test that crashed.
    # What the forkserver imported (torch, Lightning, transformers: half a million objects) lives as long as the rank:
    # kept out of the collector, a full collection no longer walks it (0.7-1.1 s each, most of a short run's time)
    # nor copies the pages it touches from the forkserver.
    gc.freeze()
    log = open(crash_log, "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        NODE_RANK="0",
    )
    import torch

    torch.set_num_threads(threads)
    try:
        # Bytes, not tensors: torch's queue pickler shares tensor storage by file descriptor, which
        # dies with the worker before the parent can read it.
        buffer = io.BytesIO()
        torch.save(fn(*args, **kwargs), buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the traceback is the message the test shows
        queue.put((rank, False, traceback.format_exc()))
    with contextlib.suppress(threading.BrokenBarrierError):
        done.wait(timeout=120)


class NativeCrash(RuntimeError):
    """A rank died by a signal of its own (abort, segmentation fault) before reporting."""


# Signals a rank raises itself when native code fails; a SIGKILL is someone's intent (the fault-tolerance tests').
_CRASHES = {-signal.SIGABRT, -signal.SIGSEGV, -signal.SIGBUS}


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300, threads: int = 1, **kwargs: Any
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world`` ranks with torch.distributed env vars set; return per-rank results.

    ``fn`` must be importable by name (a module-level function). Each rank computes with ``threads`` threads.

    A launch in which a rank crashes natively (in gloo's or torch's C++, with no Python error) runs once more, with
    the crash's stacks as a warning: the same crash twice, any Python error and any wrong result still fail.
    """
    try:
        return _launch(fn, world, args, kwargs, timeout, threads)
    except NativeCrash as crash:
        name = getattr(fn, "__name__", fn)
        warnings.warn(f"relaunched {name} after a native crash: {crash}", RuntimeWarning, stacklevel=2)
        return _launch(fn, world, args, kwargs, timeout, threads)


def _launch(fn: Callable[..., Any], world: int, args: tuple, kwargs: dict, timeout: float, threads: int) -> list[Any]:
    port = free_port()
    queue, done = _CTX.SimpleQueue(), _CTX.Barrier(world)
    logs = tempfile.mkdtemp(prefix="ranks-")
    crash_logs = [os.path.join(logs, f"rank{r}.txt") for r in range(world)]
    procs = [_CTX.Process(target=_worker, args=(fn, r, world, port, args, kwargs, queue, done, crash_logs[r], threads))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    reported: set[int] = set()  # returned a result or raised
    deadline = time.monotonic() + timeout
    while len(reported) < world:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            dead = {r for r, p in enumerate(procs) if p.exitcode is not None and r not in reported}
            if dead and queue.empty():
                if len(reported | dead) == world:
                    break
                # A rank died without reporting: its peers fail in a collective and report that, which takes a moment.
                deadline = min(deadline, time.monotonic() + 5)
            time.sleep(0.05)
            continue
        rank, ok, value = queue.get()
        reported.add(rank)
        if ok:
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{value}")
    if len(reported) < world:
        done.abort()  # release the ranks that reported from waiting for the one that will not
    codes: list[int | None] = []
    for p in procs:
        p.join(timeout=5)
        codes.append(p.exitcode)
        if p.is_alive():
            os.kill(p.pid, signal.SIGUSR1)  # where it waits, beside the peer that died
            time.sleep(1)
            p.kill()
    try:
        if len(results) != world:
            stacks = "".join(_stack_report(r, code, path) for r, (code, path) in enumerate(zip(codes, crash_logs))
                             if r not in reported)
            died = [f"rank {r} died ({codes[r]}) at {_innermost(crash_logs[r])}" for r in range(world)
                    if codes[r] not in (None, 0) and r not in reported]
            crashed = any(codes[r] in _CRASHES for r in range(world) if r not in reported)
            if any(codes[r] == 1 and not _faulthandler_lines(crash_logs[r]) for r in range(world) if r not in reported):
                # Exited before the rank function ran: each rank imports the starting script again, which runs
                # its top-level code (multiprocessing's "safe importing of main module").
                stacks += ("\nA rank that exits with code 1 before running is most often a script that starts ranks"
                           " from its top-level code: put that code under `if __name__ == \"__main__\":`. The rank's"
                           " own message is on this process's stderr.")
            raise (NativeCrash if crashed else RuntimeError)("\n".join([
                *died,  # first, so that a summary's one line tells where a native crash happened
                *errors,
                f"ranks {sorted(results)} of {world} returned, ranks {sorted(reported - set(results))} raised (above),"
                f" ranks {sorted(set(range(world)) - reported)} never reported (exit codes {codes}, timeout"
                f" {timeout}s){stacks}"
            ]))
        return [results[r] for r in range(world)]
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def _faulthandler_lines(path: str) -> list[str]:
    """What faulthandler wrote for a rank, the crashing (or signalled) thread first: it lists every thread."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return []
    blocks = [b for b in text.split("\n\n") if b and not b.startswith("Extension modules:")]
    blocks.sort(key=lambda b: not b.lstrip().startswith("Current thread"))
    return "\n".join(blocks).splitlines()


def _stack_report(rank: int, code: int | None, path: str, lines: int = 30) -> str:
    kept = _faulthandler_lines(path)[:lines]
    state = "still running" if code is None else f"exit code {code}"
    return f"\nrank {rank} ({state}):\n" + "\n".join(kept) if kept else ""


def _innermost(path: str) -> str:
    frames = [line.strip() for line in _faulthandler_lines(path) if line.startswith("  File ")]
    return frames[0] if frames else "no Python frame"
