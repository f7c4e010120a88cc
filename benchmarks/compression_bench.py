"""Gradient compression benchmark: bytes, final validation loss and steps/s over a slow link, side by side.

Part 1 (quality): the example GPT on the offline corpus, dp2 (ZeRO-0) for a fixed number of steps, once
uncompressed and once per compressor: gradient bytes per rank (raw fp32 vs sent) and final validation loss.

Part 2 (slow link): the same two ranks, each in its own network namespace, joined by a veth pair whose
egress is shaped with ``tc tbf`` to 100 Mbit/s and 1 Gbit/s. Ranks are real ``LLMParallelStrategy``
processes (Lightning's torchelastic environment: one process per "node"), so the measured code is the
strategy's own compressed gradient sync. Namespaces and veth are always removed afterwards.

Run from the repository root (as root, for part 2):  python -m benchmarks.compression_bench
Writes benchmarks/results/compression.json.  ``--skip-link`` runs part 1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.data import CorpusDataModule
from lightning_llmpar.launch import run_ranks
from lightning_llmpar.models import GPTModule

OUT = Path(__file__).parent / "results" / "compression.json"
MODEL = {"n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 128, "block_size": 128, "learning_rate": 3e-3,
         "warmup_steps": 20}
DATA = {"block_size": 128, "batch_size": 8, "max_bytes": 2_000_000}
# 2000 steps: compressed runs start slower (PowerSGD's factors and top-k's residuals need steps to settle);
# a comparison after a few hundred steps measures that start, not where training gets to.
STEPS, VAL_BATCHES, CLIP = 2000, 40, 1.0
# PowerSGD rank 4 after 10 uncompressed steps (the first steps' gradients are large and change direction
# quickly) and rank 8 (6% of this model's width of 128; the ratio of a rank grows with the width); top-k
# 1%, 5% and 6.25% (values + int32 indices: 8x fewer bytes) with error feedback; int8 in chunks of 1024.
METHODS: dict[str, Any] = {
    "none": None,
    "fp16": "fp16",
    "bf16": "bf16",
    "int8": "int8",
    "topk": {"method": "topk", "fraction": 0.01},
    "topk_5pct": {"method": "topk", "fraction": 0.05},
    "topk_8x": {"method": "topk", "fraction": 0.0625},
    "powersgd": {"method": "powersgd", "rank": 4, "start_step": 10},
    "powersgd_r8": {"method": "powersgd", "rank": 8, "start_step": 10},
}
QUALITY_METHODS = ("none", "fp16", "int8", "topk_8x", "powersgd_r8")
# The slow-link settings as measured: PowerSGD rank 8 starts compressing at step 5, before the timed steps.
LINK_SETTINGS: dict[str, Any] = {**{m: METHODS[m] for m in ("none", "fp16", "int8", "topk", "powersgd")},
                                 "powersgd_r8": {"method": "powersgd", "rank": 8, "start_step": 5}}
LINK_METHODS = tuple(LINK_SETTINGS)
LINK_STEPS, LINK_SKIP = 30, 5
RATES = ("100mbit", "1gbit")


class _Bytes(Callback):
    """Sums the per-step byte counts the strategy logs, and times training steps."""

    def __init__(self) -> None:
        self.raw = self.sent = 0.0
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)
        metrics = trainer.callback_metrics
        if "compression/raw_bytes" in metrics:
            self.raw += float(metrics["compression/raw_bytes"])
            self.sent += float(metrics["compression/sent_bytes"])


def train(
    compression: Any, steps: int, val_batches: int, num_nodes: int = 1, clip: float | None = None
) -> dict[str, Any]:
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    module = GPTModule(**MODEL, total_steps=steps)
    probe = _Bytes()
    kwargs = {"zero_stage": 0} if compression is None else {"zero_stage": 0, "gradient_compression": compression}
    world = int(os.environ["WORLD_SIZE"])  # read now: Lightning's environment teardown removes it
    devices = world // num_nodes
    trainer = Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=LLMParallelStrategy(**kwargs),
                      max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=val_batches,
                      val_check_interval=None, check_val_every_n_epoch=None, callbacks=[probe],
                      gradient_clip_val=clip)
    data = CorpusDataModule(**DATA)
    trainer.fit(module, datamodule=data)
    val = trainer.validate(module, datamodule=data, verbose=False)[0] if val_batches else {}
    # The logged bytes are summed over the ranks.
    return {"val_loss": val.get("val/loss"), "raw_bytes_per_rank": probe.raw / world,
            "sent_bytes_per_rank": probe.sent / world, "step_times": probe.times,
            "params": sum(p.numel() for p in module.parameters())}


def quality() -> list[dict[str, Any]]:
    rows = []
    for name in QUALITY_METHODS:
        compression = METHODS[name]
        t0 = time.perf_counter()
        out = run_ranks(train, 2, compression, STEPS, VAL_BATCHES, clip=CLIP, timeout=3600)[0]
        raw = out["raw_bytes_per_rank"] or 4 * out["params"] * STEPS
        sent = out["sent_bytes_per_rank"] or raw
        rows.append({"method": name, "setting": compression, "val_loss": round(out["val_loss"], 4),
                     "gradient_mb_per_rank": round(sent / 2**20, 1), "raw_mb_per_rank": round(raw / 2**20, 1),
                     "ratio": round(raw / sent, 2), "wall_s": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["val_loss"]
    for row in rows:
        row["val_loss_vs_none_pct"] = round(100 * (row["val_loss"] - base) / base, 2)
    return rows


# ----------------------------------------------------------------------------- slow link

NS, VETH, ADDR = ("llmpar_cb0", "llmpar_cb1"), ("llmpar_v0", "llmpar_v1"), ("10.231.7.1", "10.231.7.2")


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _make_link() -> None:
    for ns in NS:
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, dev, addr in zip(NS, VETH, ADDR):
        _sh("ip", "link", "set", dev, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")


def _shape(rate: str) -> None:
    for ns, dev in zip(NS, VETH):  # both directions: each side shapes what it sends
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True,
                       check=False)  # absent the first time
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
            "burst", "256kb", "latency", "50ms")


def _remove_link() -> None:
    for ns in NS:  # deleting a namespace deletes the veth end inside it, and with it the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)  # may not exist


def link_worker(method: str) -> None:
    """One rank of a slow-link run (started inside a namespace by ``slow_link``); prints its step times."""
    out = train(LINK_SETTINGS[method], LINK_STEPS, 0, num_nodes=2)
    print("RESULT " + json.dumps({"step_times": out["step_times"]}), flush=True)


def _link_run(method: str, port: int) -> float:
    procs = []
    for rank, (ns, dev) in enumerate(zip(NS, VETH)):
        env = {**os.environ, "MASTER_ADDR": ADDR[0], "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank), "NODE_RANK": str(rank),
               "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1",
               "TORCHELASTIC_RUN_ID": "compression_bench"}  # Lightning detects a torchelastic launch from it
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "benchmarks.compression_bench", "--worker", method]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"slow-link run {method} failed:\n" + "\n".join(o[1][-3000:] for o in outs))
    lines = [line for out in outs for line in out[0].splitlines() if line.startswith("RESULT ")]
    times = [json.loads(line[len("RESULT "):])["step_times"] for line in lines]
    steady = [max(ts) for ts in zip(*(t[LINK_SKIP:] for t in times))]  # a step ends when the slower rank ends
    # The median step, not the mean: on a shared host a few steps stalled by other processes would dominate.
    return 1.0 / statistics.median(steady)


def slow_link() -> list[dict[str, Any]]:
    rows = []
    _remove_link()
    try:
        _make_link()
        port = 29611
        for rate in RATES:
            _shape(rate)
            speeds = {}
            for method in LINK_METHODS:
                port += 1
                speeds[method] = _link_run(method, port)
                print(f"{rate} {method}: {speeds[method]:.2f} steps/s", flush=True)
            rows.append({"rate": rate, "load_average_1min": os.getloadavg()[0],
                         "steps_per_s": {m: round(v, 3) for m, v in speeds.items()},
                         "speedup_vs_none": {m: round(v / speeds["none"], 2) for m, v in speeds.items()}})
    finally:
        _remove_link()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--skip-link", action="store_true", help="only the bytes / validation-loss comparison")
    parser.add_argument("--skip-quality", action="store_true", help="only the slow-link comparison")
    args = parser.parse_args()
    if args.worker:
        link_worker(args.worker)
        return
    previous = json.loads(OUT.read_text()) if OUT.is_file() else {}
    result: dict[str, Any] = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                              "dp": 2, "zero_stage": 0, "model": MODEL, "data": DATA}
    result["quality"] = previous.get("quality") if args.skip_quality else {"steps": STEPS, "val_batches": VAL_BATCHES,
                                                                          "gradient_clip_val": CLIP, "rows": quality()}
    result["slow_link"] = previous.get("slow_link") if args.skip_link else {
        "steps": LINK_STEPS, "timed_steps": LINK_STEPS - LINK_SKIP, "rows": slow_link(),
        "how": "2 ranks in 2 network namespaces, veth pair, tc tbf on each side's egress; ranks are"
               " LLMParallelStrategy processes in Lightning's torchelastic environment (num_nodes=2)"}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(f"-> {OUT}")


if __name__ == "__main__":
    main()
