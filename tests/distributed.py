"""Run a function on N real gloo ranks (no mocks) and collect what each rank returns.

Workers come from a forkserver that has already imported torch and Lightning, so a rank starts in
a fraction of a second and never inherits an OpenMP pool from the test process (which can hang a fork).
No rank exits before every rank has reported: a rank still tearing down its process groups when a peer's
sockets close can be aborted by gloo's background thread, losing its result.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "lightning", "torchmetrics", "lightning_llmpar", "tests.workloads"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, kwargs: dict, queue: Any, done: Any
) -> None:
    faulthandler.enable(all_threads=True)  # a native abort (SIGABRT, SIGSEGV) shows where each thread was
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

    torch.set_num_threads(1)
    try:
        # Bytes, not tensors: torch's queue pickler shares tensor storage by file descriptor, which
        # dies with the worker before the parent can read it.
        buffer = io.BytesIO()
        torch.save(fn(*args, **kwargs), buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the traceback is the message the test shows
        queue.put((rank, False, traceback.format_exc()))
    try:
        done.wait(timeout=120)
    except threading.BrokenBarrierError:
        pass


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300, **kwargs: Any) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world`` ranks with torch.distributed env vars set; return per-rank results."""
    port = free_port()
    queue, done = _CTX.SimpleQueue(), _CTX.Barrier(world)
    procs = [_CTX.Process(target=_worker, args=(fn, r, world, port, args, kwargs, queue, done)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    reported: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(reported) < world:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if any(p.exitcode is not None and r not in reported for r, p in enumerate(procs)) and queue.empty():
                break  # a rank died without reporting (its peers wait for it at the barrier)
            time.sleep(0.05)
            continue
        rank, ok, value = queue.get()
        reported.add(rank)
        if ok:
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    if len(results) != world:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"only {sorted(results)} of {world} ranks finished (exit codes {codes}, timeout {timeout}s)")
    return [results[r] for r in range(world)]
