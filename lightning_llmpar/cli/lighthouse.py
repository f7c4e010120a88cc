"""`llmpar lighthouse`: torchft's lighthouse, the server replica groups ask for each step's quorum."""

from __future__ import annotations

import argparse
import signal
import threading

__all__ = ["lighthouse_command"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmpar lighthouse", description=lighthouse_command.__doc__)
    parser.add_argument("--port", type=int, default=29510, help="port to listen on (0: any free port)")
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="replica groups needed for a quorum; 1 lets a lone survivor keep training")
    parser.add_argument("--join-timeout-ms", type=int, default=60_000,
                        help="how long a quorum waits for groups that heartbeat but have not asked yet")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5_000,
                        help="silence after which a replica group is dropped from the next quorum")
    parser.add_argument("--quorum-tick-ms", type=int, default=100)
    return parser


def lighthouse_command(argv: list[str], stop: threading.Event | None = None) -> int:
    """Serve torchft's lighthouse until interrupted (or ``stop`` is set). Print its address: each replica group's
    job gets it as TORCHFT_LIGHTHOUSE (see docs/fault-tolerance.md)."""
    args = _parser().parse_args(argv)
    if args.min_replicas < 1:
        raise ValueError(f"--min-replicas must be at least 1, got {args.min_replicas}.")
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        raise ValueError("llmpar lighthouse needs the torchft package: pip install 'lightning_llmpar[ft]'.") from None
    server = LighthouseServer(bind=f"[::]:{args.port}", min_replicas=args.min_replicas,
                              join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=args.quorum_tick_ms,
                              heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    print(f"TORCHFT_LIGHTHOUSE={server.address()}", flush=True)
    try:
        stop.wait()
    finally:
        server.shutdown()
    return 0
