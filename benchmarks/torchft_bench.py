"""Replica groups on torchft with the example GPT (examples/configs/torchft.yaml), as users run them.

1. Quorum overhead without failures: per-step time of two replica groups of one process each (fault_tolerance=
   "torchft") beside one plain job with two data-parallel processes, each from the wall time difference of two
   runs (``--short`` and ``--long`` steps) so start-up cancels out; the runs alternate, side by side in time.
2. Kills: two groups train; ``--kills`` times, at a random moment, kill -9 one group (alternating), start it
   again at once, and read torchft's own log lines: the survivor's discarded steps (``should_commit=false``), the
   time from the kill to the restarted group's first committed step, and from its quorum's heal order to it.

Run from the repository root:  python -m benchmarks.torchft_bench [--kills 10]
Writes benchmarks/results/torchft.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "torchft.yaml"
OUT = Path(__file__).parent / "results" / "torchft.json"
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
         "--trainer.enable_checkpointing", "false"]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+) ")


def _fit(work: Path, name: str, steps: int, env: dict[str, str], extra: list[str]) -> tuple[subprocess.Popen, Path]:
    log = work / f"{name}.log"
    cmd = [sys.executable, "-m", "lightning_llmpar.cli", "fit", "--config", str(CONFIG),
           "--trainer.max_steps", str(steps), *QUIET, *extra]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", **env}
    return subprocess.Popen(cmd, cwd=work, env=full_env, stdout=log.open("w"), stderr=subprocess.STDOUT), log


def _group_env(lighthouse: str, gid: int) -> dict[str, str]:
    return {"REPLICA_GROUP_ID": str(gid), "NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": lighthouse,
            "MASTER_PORT": str(_free_port())}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wall(work: Path, lighthouse: str, steps: int, torchft: bool) -> float:
    t0 = time.perf_counter()
    if torchft:
        procs = [_fit(work, f"ft{g}_{steps}", steps, _group_env(lighthouse, g), [])[0] for g in (0, 1)]
    else:
        procs = [_fit(work, f"dp2_{steps}", steps, {}, ["--trainer.devices", "2",
                                                         "--trainer.strategy.fault_tolerance", "null"])[0]]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise RuntimeError(f"a run failed ({codes}); logs in {work}")
    return time.perf_counter() - t0


def _times(log: Path, pattern: str) -> list[float]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        if m and pattern in line:
            out.append(datetime.fromisoformat(m.group(1)).timestamp())
    return out


def overhead(work: Path, lighthouse: str, short: int, long: int, repeats: int) -> dict:
    # The plain job: wall-time difference of a long and a short run. The groups: the median interval between
    # group 0's committed steps (torchft's log), as the groups' start-up varies by seconds (first quorum).
    per_step: dict[str, list[float]] = {"dp2": [], "torchft": [], "torchft_wall_difference": []}
    for _ in range(repeats):
        per_step["dp2"].append((_wall(work, lighthouse, long, False) - _wall(work, lighthouse, short, False)) / (long - short))
        per_step["torchft_wall_difference"].append(
            (_wall(work, lighthouse, long, True) - _wall(work, lighthouse, short, True)) / (long - short))
        commits = _times(work / f"ft0_{long}.log", "should_commit completed should_commit=true")[3:]
        gaps = sorted(b - a for a, b in itertools.pairwise(commits))
        per_step["torchft"].append(gaps[len(gaps) // 2])
    # The overhead compares like with like: the wall-time difference of both layouts, best of the repeats (the
    # least disturbed by anything else on the machine). The commit gaps are kept beside it as a check.
    best = {k: min(v) for k, v in per_step.items()}
    median = {k: sorted(v)[len(v) // 2] for k, v in per_step.items()}
    return {"steps": [short, long], "per_step_s": per_step, "best_per_step_s": best, "median_per_step_s": median,
            "overhead": best["torchft_wall_difference"] / best["dp2"] - 1,
            "overhead_of_medians": median["torchft_wall_difference"] / median["dp2"] - 1}


def kills(work: Path, lighthouse: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    procs = {g: _fit(work, f"kill_g{g}_0", 10**6, _group_env(lighthouse, g), []) for g in (0, 1)}
    rows = []
    try:
        time.sleep(60)  # both groups past start-up and training together before the first kill
        for i in range(n):
            victim, survivor = i % 2, 1 - i % 2
            time.sleep(rng.uniform(3.0, 10.0))  # a random moment of the step loop
            s_log = procs[survivor][1]
            false_before = len(_times(s_log, "should_commit completed should_commit=false"))
            procs[victim][0].send_signal(signal.SIGKILL)
            killed_at = time.time()
            procs[victim][0].wait(timeout=60)
            procs[victim] = _fit(work, f"kill_g{victim}_{i + 1}", 10**6, _group_env(lighthouse, victim), [])
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:  # the restarted group's first committed step, in its own log
                healed = _times(procs[victim][1], "should_commit completed should_commit=true")
                if healed:
                    break
                if procs[victim][0].poll() is not None or procs[survivor][0].poll() is not None:
                    raise RuntimeError(f"a group exited during kill {i}; logs in {work}")
                time.sleep(0.5)
            else:
                raise RuntimeError(f"kill {i}: the restarted group did not commit a step in 600 s; logs in {work}")
            heal_order = _times(procs[victim][1], "healing is required")
            lost = len(_times(s_log, "should_commit completed should_commit=false")) - false_before
            rows.append({"victim": victim, "survivor_steps_discarded": lost,
                         "kill_to_first_commit_s": healed[0] - killed_at,
                         "heal_order_to_first_commit_s": healed[0] - heal_order[0] if heal_order else None,
                         "healed": bool(heal_order)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for p, _ in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    return rows


def main() -> None:
    from torchft.coordination import LighthouseServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--short", type=int, default=10)
    ap.add_argument("--long", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-overhead", action="store_true")
    args = ap.parse_args()
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=5_000)
    lighthouse = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    # A run of one part keeps the other part's figures from an earlier run, each with the command that made it.
    result: dict = json.loads(OUT.read_text()) if OUT.exists() else {}
    command = "python -m benchmarks.torchft_bench " + " ".join(sys.argv[1:])
    result.update({"command": command, "load": os.getloadavg(), "cpus": os.cpu_count(),
                   "config": str(CONFIG.relative_to(ROOT))})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if not args.skip_overhead:
                result["overhead"] = {"command": command, "load_before": os.getloadavg(),
                                      **overhead(work, lighthouse, args.short, args.long, args.repeats)}
                print(json.dumps(result["overhead"]), flush=True)
            if args.kills:
                rows = kills(work, lighthouse, args.kills, args.seed)
                result["kills"] = {"command": command, "trials": rows,
                                   "survivor_steps_discarded_total": sum(r["survivor_steps_discarded"] for r in rows),
                                   "kill_to_first_commit_s_median": sorted(r["kill_to_first_commit_s"] for r in rows)[len(rows) // 2]}
    finally:
        server.shutdown()
    result["load_after"] = os.getloadavg()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
