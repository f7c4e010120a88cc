"""Background checkpoint saves (``async_checkpoint=True``): the training stall per checkpoint against synchronous
saves, and kill -9 trials while background writes are in flight.

Run from the repository root:  python -m benchmarks.async_checkpoint_bench [--runs 2 --kills 10] [--part stall|kill]
Writes benchmarks/results/async_checkpoint.json. Every run is 2 ranks on gloo: the stall runs are started by torchrun;
in the kill trials a killed rank makes the driver kill its peer and start the job again on a fresh port (as torchrun
``--max-restarts`` or a cluster requeue would), and the job resumes from the newest committed checkpoint.

- Stall: a stack of 9 Linear(2048, 2048) layers under ZeRO-3 on 2 ranks (227 MB of parameters and Adam state per
  rank), a checkpoint every 3 steps; the stall is the time ``trainer.save_checkpoint`` blocks the training loop
  (the checkpoint callback's save, timed), synchronous and background, in one invocation.
- Kill trials: a smaller stack (4 x Linear(1024, 1024), 25 MB per rank) training 24 steps, saving every 2. In each of
  the first ``--kills`` launches of a run a random rank kills itself with SIGKILL 0-0.25 s after the first or second
  save of that launch was handed to the background (whether the write was still in flight is recorded); the job is
  started again and resumes. Each run must end equal to the uninterrupted run (final weights bit for bit, the samples
  of every step) and see each sample of each epoch once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

OUT = Path(__file__).parent / "results" / "async_checkpoint.json"
MODELS = {"big": (2048, 9, 4), "small": (1024, 4, 4)}  # width, layers, samples per rank and step
SAMPLES = 96


# ----------------------------------------------------------------------------------------------- worker (one rank)


class _Samples(Dataset):
    def __init__(self, width: int) -> None:
        g = torch.Generator().manual_seed(11)
        self.x, self.y = torch.randn(SAMPLES, width, generator=g), torch.randn(SAMPLES, width, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def _module(width: int, layers: int, out: Path) -> Any:
    from lightning.pytorch import LightningModule

    class Stack(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, ids = batch
            with open(out / f"seen_rank{self.global_rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": self.trainer.global_step, "ids": ids.tolist()}) + "\n")
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return Stack()


class _Killer:
    """In each of the first ``kills`` launches of a run: on a random rank, SIGKILL a random delay after the first or
    second save of the launch was handed to the background."""

    def __init__(self, out: Path, seed: int, kills: int) -> None:
        self.out, self.launch = out, int(os.environ.get("BENCH_LAUNCH", "0"))
        rng = random.Random(seed * 100 + self.launch)
        self.victim, self.save_index, self.delay = rng.randrange(2), rng.randrange(1, 3), rng.uniform(0.0, 0.25)
        self.armed, self.saves = self.launch < kills, 0

    def after_save(self, trainer: Any) -> None:
        self.saves += 1
        staging = trainer.strategy.checkpoint_in_flight
        if self.armed and self.saves == self.save_index and trainer.global_rank == self.victim and staging is not None:
            threading.Timer(self.delay, self._kill, (trainer, staging)).start()

    def _kill(self, trainer: Any, staging: Path) -> None:
        in_flight = trainer.strategy.checkpoint_in_flight == staging and staging.exists()
        record = {"launch": self.launch, "rank": trainer.global_rank, "step": trainer.global_step, "save": staging.name,
                  "delay_s": round(self.delay, 3), "in_flight": in_flight}
        with open(self.out / "kills.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)


def worker(args: argparse.Namespace) -> None:
    from lightning.pytorch import Trainer, seed_everything

    from lightning_llmpar import LLMParallelStrategy
    from lightning_llmpar.fault_tolerance.callbacks import FaultTolerantCheckpoint
    from lightning_llmpar.fault_tolerance.sampler import ResumableDistributedSampler

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    width, layers, batch = MODELS[args.model]
    stalls: list[float] = []
    killer = _Killer(out, args.kill_seed, args.kills) if args.kill_seed is not None else None

    class TimedCheckpoint(FaultTolerantCheckpoint):
        def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
            start = time.perf_counter()
            super()._save_checkpoint(trainer, filepath)
            stalls.append(time.perf_counter() - start)
            if killer is not None:
                killer.after_save(trainer)

    seed_everything(0, verbose=False)
    module = _module(width, layers, out)
    callbacks: list[Any] = [TimedCheckpoint(str(out / "ckpt"), every_n_train_steps=args.save_every, keep_last=2)]
    strategy = LLMParallelStrategy(zero_stage=3, async_checkpoint=args.background)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                      callbacks=callbacks)
    data = _Samples(width)
    sampler = ResumableDistributedSampler(data, shuffle=True, seed=5, num_replicas=2, rank=int(os.environ["RANK"]))
    start = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True), ckpt_path="last")
    fit_s = time.perf_counter() - start
    weights = {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}
    if trainer.global_rank == 0:
        torch.save(weights, out / "final.pt")
        state_mb = sum(t.numel() * 4 * 3 for t in weights.values()) / 2 / 1e6  # weights + Adam's two moments, / 2 ranks
        timing = {"stalls_s": stalls, "fit_s": fit_s, "state_mb_per_rank": state_mb}
        (out / "timing.json").write_text(json.dumps(timing))


# ----------------------------------------------------------------------------------------------- driver


def _torchrun(out: Path, *flags: str, restarts: int = 0, timeout: float = 2400) -> float:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", str(restarts), "--monitor-interval", "0.5", "-m", "benchmarks.async_checkpoint_bench",
               "--worker", "--out", str(out), *flags]
    start = time.perf_counter()
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return time.perf_counter() - start


def _restarting(out: Path, flags: list[str], restarts: int, timeout: float = 2400) -> int:
    """Start 2 ranks; when one dies, kill the other and start the job again (as torchrun --max-restarts or a
    cluster requeue would), on a fresh port. Returns how many launches failed."""
    deadline = time.monotonic() + timeout
    for launch in range(restarts + 1):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
               "GROUP_RANK": "0", "BENCH_LAUNCH": str(launch)}
        with open(out / f"launch{launch}.log", "w") as log:
            ranks = [subprocess.Popen([sys.executable, "-m", "benchmarks.async_checkpoint_bench", "--worker", "--out",
                                       str(out), *flags], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                      stdout=log, stderr=subprocess.STDOUT) for r in range(2)]
            while any(p.poll() is None for p in ranks) and all(p.poll() in (None, 0) for p in ranks):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                p.wait()
        if all(p.returncode == 0 for p in ranks):
            return launch
    raise RuntimeError(f"{out}: the job did not finish within {restarts} restarts")


def _committed(out: Path) -> dict[str, list[int]]:
    """(rank, step) -> sample ids of the step that counted: a step replayed after a restart overwrites."""
    seen: dict[str, list[int]] = {}
    for rank in (0, 1):
        for line in (out / f"seen_rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            seen[f"{rank}:{record['step']}"] = record["ids"]
    return seen


def _same_run(run: Path, ref: Path, steps: int, per_step: int) -> dict[str, bool]:
    a, b = torch.load(run / "final.pt"), torch.load(ref / "final.pt")
    seen, epoch_steps = _committed(run), SAMPLES // per_step
    epochs = [sorted(i for key, ids in seen.items() if int(key.split(":")[1]) // epoch_steps == e for i in ids)
              for e in range(steps // epoch_steps)]
    return {"weights_identical": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b),
            "samples_of_every_step_identical": seen == _committed(ref),
            "each_sample_once_per_epoch": all(ids == list(range(SAMPLES)) for ids in epochs)}


def stall(root: Path, steps: int, every: int, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"synchronous": [], "background": []}
    for r in range(rounds):  # alternated, so both see the same load on a shared machine
        for name, flags in (("synchronous", []), ("background", ["--background"])):
            out = root / f"stall_{name}_{r}"
            _torchrun(out, "--model", "big", "--steps", str(steps), "--save-every", str(every), *flags)
            runs[name].append(json.loads((out / "timing.json").read_text()))
            shutil.rmtree(out, ignore_errors=True)
    result: dict[str, Any] = {"state_mb_per_rank": round(runs["synchronous"][0]["state_mb_per_rank"], 1),
                              "checkpoints_per_run": len(runs["synchronous"][0]["stalls_s"]), "runs_each": rounds}
    for name, rows in runs.items():
        later = [s for row in rows for s in row["stalls_s"][1:]]  # the first allocates the staging buffers
        result[name] = {"stall_s_median": round(statistics.median(later), 3),
                        "stall_s_first_save": [round(row["stalls_s"][0], 3) for row in rows],
                        "stalls_s": [[round(s, 3) for s in row["stalls_s"]] for row in rows],
                        "fit_s": [round(row["fit_s"], 2) for row in rows]}
    result["async_stall_over_sync_save"] = round(
        result["background"]["stall_s_median"] / result["synchronous"]["stall_s_median"], 3)
    result["target"] = "async stall <= 0.2 x synchronous save time"
    result["target_met"] = result["async_stall_over_sync_save"] <= 0.2
    return result


def _kill_run(
    root: Path, run: int, kills: int, flags: list[str], ref: Path, steps: int, per_step: int
) -> dict[str, Any]:
    out = root / f"run{run}"
    out.mkdir(parents=True)
    start = time.perf_counter()
    try:
        failed = _restarting(out, [*flags, "--kill-seed", str(1000 + run), "--kills", str(kills)], restarts=kills)
        checks: dict[str, Any] = _same_run(out, ref, steps, per_step)
    except RuntimeError as err:  # a run that did not finish is a failed run
        failed, checks = -1, {"error": str(err)}
    kills_file = out / "kills.jsonl"
    killed = [json.loads(line) for line in kills_file.read_text().splitlines()] if kills_file.exists() else []
    row = {"run": run, "kills": killed, "failed_launches": failed, **checks,
           # A run that reaches its last step before its last planned kill has fewer kills; each kill it had must
           # be one failed launch, and the finished run must match the uninterrupted one.
           "passed": 0 < len(killed) == failed and all(v is True for v in checks.values()),
           "wall_s": round(time.perf_counter() - start, 1),
           "partial_left": sorted(p.name for p in (out / "ckpt").glob(".*.partial"))}
    print(json.dumps(row), flush=True)
    return row


def kill_trials(root: Path, runs: int, kills: int, steps: int, every: int) -> dict[str, Any]:
    _, _, per_rank = MODELS["small"]
    ref = root / "kill_reference"
    ref.mkdir(parents=True)
    flags = ["--model", "small", "--steps", str(steps), "--save-every", str(every), "--background"]
    start = time.perf_counter()
    _restarting(ref, flags, restarts=0)
    ref_s = time.perf_counter() - start
    # The runs go side by side: on a shared machine each job's launches are mostly waiting for a core.
    rows: list[dict[str, Any]] = [{}] * runs
    threads = [threading.Thread(target=lambda r=r: rows.__setitem__(r, _kill_run(root, r, kills, flags, ref, steps,
                                                                                   2 * per_rank))) for r in range(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kill_rows = [k for r in rows for k in r["kills"]]
    return {"kills": len(kill_rows), "runs": runs, "kills_planned_per_run": kills,
            "runs_passed": sum(r["passed"] for r in rows),
            "kills_in_passed_runs": sum(len(r["kills"]) for r in rows if r["passed"]),
            "killed_while_write_in_flight": sum(k["in_flight"] for k in kill_rows),
            "uninterrupted_run_s": round(ref_s, 1), "run_with_kills_s": [r["wall_s"] for r in rows],
            "launcher": "2 rank processes per launch; when one dies, the other is killed and the job started again",
            "steps": steps, "save_every": every, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", choices=list(MODELS), default="small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--background", action="store_true")
    parser.add_argument("--kill-seed", type=int)
    parser.add_argument("--kills", type=int, default=10, help="kills per run (each followed by a restart)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--part", choices=["all", "stall", "kill"], default="all")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    root = Path(tempfile.mkdtemp(prefix="llmpar-async-", dir=os.environ.get("BENCH_DIR", "/var/tmp")))
    result: dict[str, Any] = json.loads(OUT.read_text()) if OUT.exists() and args.part != "all" else {}
    result["machine"] = f"{os.cpu_count()} CPU cores, gloo, torch {torch.__version__}; checkpoints on {root}"
    if args.part in ("all", "stall"):
        result["stall"] = stall(root, steps=12, every=3, rounds=args.rounds)
        print(json.dumps(result["stall"]), flush=True)
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(result, indent=2))
    if args.part in ("all", "kill"):
        result["kill_trials"] = kill_trials(root, args.runs, args.kills, steps=24, every=2)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "kill_trials"}), f"-> {OUT}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
