"""DiLoCo vs synchronous data parallelism between two replica groups on a slow link.

compression_bench's slow link: two network namespaces joined by a veth pair, each side's egress shaped with
``tc tbf``. Each replica group runs in its own namespace (the lighthouse beside group 0), so every byte between
the groups crosses the shaped link. Each namespace gets a host name of its own (``unshare --uts``) and a hosts
file naming both (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` mounts): torchft advertises a group by host
name, and gloo binds to the address its host name resolves to. Each group is one process training
the example GPT (byte vocabulary, 4 blocks of width 256, ~3.2M parameters, 13 MB of fp32 weights) on the bundled
corpus with ``LLMParallelStrategy(fault_tolerance="torchft")``: synchronously (gradients averaged every step), and
with ``data_parallel_sync="diloco"`` at H = 1 (outer SGD lr 1, no momentum: must equal synchronous), 10 and 50
(outer Nesterov SGD 0.7 / 0.9). Every run takes the same steps on the same data, so the same tokens.

Figures per run: bytes that crossed the link per step (both veth ends' transmit counters), steps/s
(mean step time over the second half, so every H-th step's sync counts), validation loss of the final weights on the corpus' held-out split.

Run as root from the repository root:  python -m benchmarks.diloco_bench [--steps 100] [--rate 100mbit]
Writes benchmarks/results/diloco.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "diloco.json"
NS, VETH, ADDR = ("llmpar_dl0", "llmpar_dl1"), ("llmpar_dv0", "llmpar_dv1"), ("10.231.9.1", "10.231.9.2")
HOSTS = tuple(f"llmpar-group{g}" for g in (0, 1))
LIGHTHOUSE_PORT = 29520
MODEL = {"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 256}
H1 = {"data_parallel_sync": "diloco", "diloco_every": 1, "diloco_outer_lr": 1.0, "diloco_outer_momentum": 0.0}
# name -> (strategy arguments beyond fault_tolerance="torchft", inner optimizer, steps: None = --steps)
RUNS: dict[str, tuple[dict[str, Any], str, int | None]] = {
    "synchronous": ({}, "adamw", None),
    "diloco_h1_plain_outer": (H1, "adamw", None),
    "diloco_h10": ({"data_parallel_sync": "diloco", "diloco_every": 10}, "adamw", None),
    "diloco_h50": ({"data_parallel_sync": "diloco", "diloco_every": 50}, "adamw", None),
    # H=1 equals synchronous training only for an inner optimizer linear in the gradient: SGD with momentum.
    "synchronous_sgd": ({}, "sgd", 20),
    "diloco_h1_plain_outer_sgd": (H1, "sgd", 20),
}


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def _make_link(rate: str) -> None:
    _remove_link()
    for ns in NS:
        _sh("ip", "netns", "add", ns)
        # ``ip netns exec`` mounts this over /etc/hosts inside the namespace: both groups' names resolve there.
        Path("/etc/netns", ns).mkdir(parents=True)
        Path("/etc/netns", ns, "hosts").write_text(
            "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(ADDR, HOSTS, strict=True)))
    _sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, dev, addr in zip(NS, VETH, ADDR, strict=True):
        _sh("ip", "link", "set", dev, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
            "burst", "256kb", "latency", "50ms")


def _remove_link() -> None:
    for ns in NS:  # deleting a namespace deletes the veth end inside it, and with it the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)  # may not exist
        hosts = Path("/etc/netns", ns, "hosts")
        if hosts.exists() and HOSTS[0] in hosts.read_text():  # only the file this benchmark writes
            hosts.unlink()
            if not any(hosts.parent.iterdir()):  # the folder too, if nothing else is in it
                hosts.parent.rmdir()


def _tx_bytes() -> int:
    return sum(int(_sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"))
               for ns, dev in zip(NS, VETH, strict=True))


def _in_namespace(g: int, argv: list[str]) -> list[str]:
    """``argv`` run in group ``g``'s namespace under its own host name."""
    return ["ip", "netns", "exec", NS[g], "unshare", "--uts", "sh", "-c", f'hostname {HOSTS[g]} && exec "$@"', "sh",
            *argv]


# ----------------------------------------------------------------------------- one replica group


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Trainer, seed_everything

    from benchmarks.workloads import StepTimer
    from lightning_llmpar import LLMParallelStrategy
    from lightning_llmpar.data import CorpusDataModule
    from lightning_llmpar.models import GPTModule

    torch.set_num_threads(1)

    class SGDModule(GPTModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    seed_everything(0, verbose=False)
    data = CorpusDataModule(block_size=MODEL["block_size"], batch_size=8)
    cls = SGDModule if args.inner == "sgd" else GPTModule  # GPTModule: AdamW with warmup and cosine decay
    module = cls(learning_rate=3e-3, warmup_steps=10, total_steps=args.steps, **MODEL)
    steps = StepTimer()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0, callbacks=[steps],
                      strategy=LLMParallelStrategy(fault_tolerance="torchft", **json.loads(args.strategy)))
    trainer.fit(module, datamodule=data)
    module.eval()
    losses = []
    with torch.no_grad():
        for i, (x, y) in enumerate(data.val_dataloader()):
            if i == 40:
                break
            logits = module(x)
            losses.append(float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())))
    later = steps.times[len(steps.times) // 2:]
    weights = torch.cat([p.detach().double().flatten() for p in module.parameters()])
    Path(args.out).write_text(json.dumps({"steps": len(steps.times), "mean_step_s": statistics.fmean(later),
                                          "val_loss": sum(losses) / len(losses),
                                          "weights_sum_and_norm": [float(weights.sum()), float(weights.norm())]}))


# ----------------------------------------------------------------------------- the driver


def _run(name: str, strategy: dict[str, Any], inner: str, steps: int, root: Path) -> dict[str, Any]:
    env_common = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "NUM_REPLICA_GROUPS": "2",
                  "TORCHFT_LIGHTHOUSE": f"http://{ADDR[0]}:{LIGHTHOUSE_PORT}", "TORCHFT_TIMEOUT_SEC": "120",
                  "TORCHFT_QUORUM_TIMEOUT_SEC": "240", "TORCHFT_CONNECT_TIMEOUT_SEC": "60"}
    lighthouse = subprocess.Popen(
        _in_namespace(0, [sys.executable, "-c",
                          "import time; from torchft.coordination import LighthouseServer;"
                          f" s = LighthouseServer(bind='[::]:{LIGHTHOUSE_PORT}', min_replicas=2, join_timeout_ms=60000);"
                          " time.sleep(100000)"]), env=env_common, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2)
    before = _tx_bytes()
    procs = []
    try:
        for g in (0, 1):
            # The group's own store listens on its end of the link: torchft hands its address to the other group.
            env = {**env_common, "REPLICA_GROUP_ID": str(g), "MASTER_ADDR": ADDR[g], "MASTER_PORT": str(29530 + g)}
            log = (root / f"{name}_{g}.log").open("w")
            procs.append(subprocess.Popen(
                _in_namespace(g, [sys.executable, "-m", "benchmarks.diloco_bench", "--worker", "--steps", str(steps),
                                  "--inner", inner, "--strategy", json.dumps(strategy),
                                  "--out", str(root / f"{name}_{g}.json")]),
                env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in [*procs, lighthouse]:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0, 0]:
        raise RuntimeError(f"{name}: exit codes {codes}; logs in {root}")
    sent = _tx_bytes() - before
    groups = [json.loads((root / f"{name}_{g}.json").read_text()) for g in (0, 1)]
    step_s = max(g["mean_step_s"] for g in groups)
    return {"strategy": strategy, "inner_optimizer": inner, "steps": steps, "link_bytes_per_step": round(sent / steps),
            "steps_per_s": round(1 / step_s, 3), "mean_step_s": round(step_s, 4),
            "val_loss": [round(g["val_loss"], 5) for g in groups],
            "weights_sum_and_norm": [g["weights_sum_and_norm"] for g in groups]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--strategy", default="{}")
    parser.add_argument("--inner", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--out")
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--only", nargs="+", choices=list(RUNS), help="run these again; keep the others' figures")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    root = Path(tempfile.mkdtemp(prefix="llmpar-diloco-"))
    _make_link(args.rate)
    try:
        rows = json.loads(OUT.read_text())["runs"] if args.only and OUT.exists() else {}
        for name, (strategy, inner, steps) in RUNS.items():
            if args.only and name not in args.only:
                continue
            rows[name] = _run(name, strategy, inner, steps or args.steps, root)
            print(name, json.dumps(rows[name]), flush=True)
    finally:
        _remove_link()
    sync = rows["synchronous"]
    a, b = (rows[n]["weights_sum_and_norm"][0] for n in ("synchronous_sgd", "diloco_h1_plain_outer_sgd"))
    h1_check = {"weights_sum_and_norm": [a, b], "max_rel_diff": max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))}
    h1_check["equal_within_1e-5"] = h1_check["max_rel_diff"] <= 1e-5
    for row in rows.values():
        row["bytes_vs_synchronous"] = round(row["link_bytes_per_step"] / sync["link_bytes_per_step"], 4)
        row["speed_vs_synchronous"] = round(row["steps_per_s"] / sync["steps_per_s"], 3)
        row["val_loss_vs_synchronous_pct"] = round(100 * (row["val_loss"][0] - sync["val_loss"][0]) / sync["val_loss"][0], 2)
    result = {"machine": f"{os.cpu_count()} CPU cores, torch, torchft 0.2.0; one process per replica group",
              "link": f"two network namespaces joined by a veth pair, each side's egress shaped with tc tbf {args.rate};"
                      " one replica group in each (the lighthouse beside group 0)",
              "model": MODEL, "batch_per_group": 8, "h1_sgd_equals_synchronous": h1_check, "runs": rows}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {OUT}")


if __name__ == "__main__":
    main()
