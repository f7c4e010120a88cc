"""Replica groups on torchft, as users run them: a lighthouse, one process per replica group, real gloo, kill -9.

Each group is ``torchft_worker.py`` in its own process with its own process group (Lightning + LLMParallelStrategy
with fault_tolerance="torchft"); the lighthouse runs in this process on a free port. Files the workers write are
the only channel back (steps, participants, committed counts, final weights).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.distributed import free_port
from tests.fault_tolerance.torchft_worker import lr_at

torchft = pytest.importorskip("torchft")

WORKER = Path(__file__).with_name("torchft_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 420  # one worker's whole run, generous for a loaded 2-core machine


@pytest.fixture
def lighthouse() -> Iterator[str]:
    from torchft.coordination import LighthouseServer

    # min_replicas=1: a lone survivor keeps training. The workers wait for each other before the first step, so
    # the first quorum holds every group; 3 s without heartbeats declares a group dead.
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=3_000)
    try:
        yield f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    finally:
        server.shutdown()


class Groups:
    """Starts workers and guarantees none outlives the test."""

    def __init__(self, out: Path, lighthouse: str, num_groups: int = 2) -> None:
        self.out, self.lighthouse, self.procs, self.num_groups = out, lighthouse, [], num_groups

    def start(self, group: str, *args: str, torchft: bool = True, ranks: int = 1, zero: int = 0,
              **env_overrides: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NUM_REPLICA_GROUPS": str(self.num_groups),
               "REPLICA_GROUP_ID": group if group.isdigit() else "0", "TORCHFT_LIGHTHOUSE": self.lighthouse,
               "TORCHFT_TIMEOUT_SEC": "120", "TORCHFT_QUORUM_TIMEOUT_SEC": "240", "TORCHFT_CONNECT_TIMEOUT_SEC": "60",
               "PYTHONFAULTHANDLER": "1", **env_overrides}  # a native abort prints every thread's Python stack
        cmd = [sys.executable, str(WORKER), "--out", str(self.out), "--group", group, *args]
        if ranks > 1:  # a group of several ranks is one torchrun job, as users start it
            cmd[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", env["MASTER_PORT"]]
            cmd += ["--devices", str(ranks), "--zero", str(zero)]
        log = (self.out / f"{group}_{len(self.procs)}.log").open("w")
        proc = subprocess.Popen(cmd + (["--torchft"] if torchft else []), env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def wait(self, proc: subprocess.Popen) -> int:
        try:
            return proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a worker ran past {TIMEOUT} s; logs in {self.out}:\n{self.logs()}") from None

    def logs(self) -> str:
        """Each worker's log tail without torchft's quorum chatter, which would push an error out of the tail."""
        def tail(path: Path) -> str:
            return "\n".join(ln for ln in path.read_text().splitlines() if "[INFO] [torchft::" not in ln)[-3000:]

        return "\n".join(f"--- {p.name}\n{tail(p)}" for p in sorted(self.out.glob("*.log")))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _logged_steps(out: Path, group: str, tag: str) -> list[int]:
    """The steps at which the group's CSV logger recorded ``train_loss``."""
    with (out / f"csv_{group}" / tag / "metrics.csv").open() as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train_loss")]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize(
    ("kwargs", "env", "match"),
    [
        ({"fault_tolerance": "raft"}, {}, "must be None or one of"),
        ({"fault_tolerance": "torchft", "tensor_parallel": 2}, {}, "tensor_parallel=2 is not supported"),
        ({"fault_tolerance": "torchft", "data_parallel_replicate": 2}, {}, "leave data_parallel_replicate"),
        ({"fault_tolerance": "torchft"}, {"REPLICA_GROUP_ID": None}, "needs REPLICA_GROUP_ID"),
        ({"fault_tolerance": "torchft"}, {"REPLICA_GROUP_ID": "2"}, r"must be in \[0, NUM_REPLICA_GROUPS=2\)"),
        # torchft waited out its whole timeout (2 minutes here) on an address without its scheme.
        ({"fault_tolerance": "torchft"}, {"TORCHFT_LIGHTHOUSE": "127.0.0.1:29510"}, "is not an address http://"),
        ({"data_parallel_sync": "diloco"}, {}, "which fault_tolerance='torchft' provides"),
        ({"diloco_every": 10}, {}, "set data_parallel_sync='diloco'"),
        ({"diloco_outer_lr": 0.5}, {}, r"diloco_outer_lr=0\.5 given but data_parallel_sync='every_step'"),
        ({"fault_tolerance": "torchft", "data_parallel_sync": "diloco", "diloco_outer_lr": float("nan")}, {},
         "must be a positive number"),
        ({"fault_tolerance": "torchft", "data_parallel_sync": "diloco", "diloco_every": 0}, {}, "positive integer"),
        ({"fault_tolerance": "torchft"}, {"TORCHFT_QUORUM_TIMEOUT_SEC": "2.5"},
         r"TORCHFT_QUORUM_TIMEOUT_SEC='2\.5' must be a positive whole number of seconds"),
        ({"fault_tolerance": "torchft", "data_parallel_sync": "diloco", "diloco_outer_momentum": 1.0}, {},
         r"must be in \[0, 1\)"),
    ],
)
def test_refusals(kwargs: dict, env: dict, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_llmpar import LLMParallelStrategy

    base = {"REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1"}
    for k, v in {**base, **env}.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        LLMParallelStrategy(**kwargs)


LAYOUTS = [pytest.param(1, 0, id="1rank"), pytest.param(2, 3, id="2ranks-zero3")]


def _two_groups_against_one_process(tmp_path: Path, lighthouse: str, *args: str, ranks: int = 1,
                                    zero: int = 0, model: str = "regression") -> tuple[list[dict], ...]:
    """Run two groups (``args`` added to each) and one process reading every rank's batch of every group at once,
    6 steps; the groups end bitwise equal and within fp32 1e-5 of the one process, and with one rank each, their
    teardown leaves no more gloo threads than the one process's. Returns each run's rows."""
    groups = Groups(tmp_path, lighthouse)
    try:
        g0 = groups.start("0", "--steps", "6", "--model", model, "--wait-ready", "1_run", *args, ranks=ranks, zero=zero)
        g1 = groups.start("1", "--steps", "6", "--model", model, "--wait-ready", "0_run", *args, ranks=ranks, zero=zero)
        ref = groups.start("ref", "--steps", "6", "--model", model, "--batch", str(16 * 2 * ranks), torchft=False)
        assert [groups.wait(p) for p in (g0, g1, ref)] == [0, 0, 0], groups.logs()
    finally:
        groups.close()
    a, b, r = (_weights(tmp_path / f"{g}_run.pt") for g in ("0", "1", "ref"))
    for k in r:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
        torch.testing.assert_close(a[k], r[k], rtol=1e-5, atol=1e-5)
    if ranks == 1:
        # Teardown released the gloo group across replica groups: fit leaves as many gloo worker threads running
        # as the same one-process fit without torchft (not one more group's until the interpreter exits).
        gloo = [sum(n.startswith("pt_gloo") for n in json.loads((tmp_path / f"{g}_run_threads.json").read_text()))
                for g in ("0", "1", "ref")]
        assert gloo[0] == gloo[1] == gloo[2], gloo
    return tuple(_rows(tmp_path / f"{g}_run.jsonl") for g in ("0", "1", "ref"))


@pytest.mark.parametrize(("ranks", "zero"), LAYOUTS)
def test_two_groups_without_failures_match_one_process(tmp_path: Path, lighthouse: str, ranks: int, zero: int) -> None:
    rows0, rows1, rows_ref = _two_groups_against_one_process(tmp_path, lighthouse, ranks=ranks, zero=zero)
    for x, y, ref_row in zip(rows0, rows1, rows_ref, strict=True):
        assert x["participants"] == y["participants"] == 2
        if ranks == 1:  # the row holds rank 0's loss; with one rank per group, each group read half the batch
            assert abs((x["loss"] + y["loss"]) / 2 - ref_row["loss"]) < 1e-5
    assert rows0[-1]["step"] == rows0[-1]["committed"] == 6


@pytest.mark.parametrize(
    ("ranks", "zero", "victims"),
    [pytest.param(1, 0, "all", id="1rank"),
     # One rank of a two-rank group dies: torchrun stops its peer, and the group is dropped and heals as a whole.
     pytest.param(2, 3, "one", id="one-of-2ranks-zero3")],
)
def test_killed_group_is_dropped_then_heals(tmp_path: Path, lighthouse: str, ranks: int, zero: int, victims: str) -> None:
    steps, kill_at, hold_at = 16, 3, 7
    groups = Groups(tmp_path, lighthouse)
    try:
        # Group 0 survives; after step 7 it waits until the restarted group 1 is about to ask for its first quorum,
        # so the heal happens mid-run (at the next step or, if that quorum formed without it, one of the next).
        g0 = groups.start("0", "--steps", str(steps), "--wait-ready", "1_run",
                          "--hold-at", str(hold_at), "--hold-for", "ready_1_restart", ranks=ranks, zero=zero)
        # Every rank of group 1 (or its rank 1 alone) kills itself with SIGKILL in the middle of the same step.
        one = ["--kill-rank", "1"] if victims == "one" else []
        g1 = groups.start("1", "--steps", str(steps), "--wait-ready", "0_run", "--kill-at", str(kill_at), *one,
                          ranks=ranks, zero=zero)
        assert groups.wait(g1) == (-signal.SIGKILL if ranks == 1 else 1), groups.logs()  # torchrun reports 1
        g1 = groups.start("1", "--steps", str(steps), "--tag", "restart", ranks=ranks, zero=zero)
        assert [groups.wait(g0), groups.wait(g1)] == [0, 0], groups.logs()
    finally:
        groups.close()
    survivor, killed, healed = (_rows(tmp_path / f) for f in ("0_run.jsonl", "1_run.jsonl", "1_restart.jsonl"))
    assert [r["step"] for r in killed] == list(range(1, kill_at + 1))  # died inside step kill_at + 1
    # The survivor loses no step: every optimizer step it counts is committed, it reaches max_steps, and it trained
    # alone while group 1 was down (at most the step in flight at the kill was discarded and taken again).
    assert all(r["step"] == r["global_step"] for r in survivor)  # Lightning counts committed steps only
    assert sorted({r["step"] for r in survivor}) == list(range(1, steps + 1))
    assert survivor[-1]["committed"] == steps and survivor[-1]["uncommitted"] <= 1
    assert len(survivor) == steps + survivor[-1]["uncommitted"]
    alone = [r["step"] for r in survivor if r["participants"] == 1]
    # The restarted group heals from the survivor: it continues at the survivor's step, not from scratch.
    joined = healed[0]["step"]
    assert hold_at < joined < steps and healed[0]["participants"] == 2, healed
    assert [r["step"] for r in healed] == list(range(joined, steps + 1))
    assert alone == list(range(kill_at + 1, joined)), survivor
    assert all(r["participants"] == 2 for r in survivor if r["step"] >= joined)
    # What the loggers record follows the committed steps too: a discarded step is not logged, and the healed group
    # logs from the step it joined at (it logged from 0, and the survivor's discarded step shifted every later row).
    assert _logged_steps(tmp_path, "0", "run") == list(range(steps))
    assert _logged_steps(tmp_path, "1", "restart") == list(range(joined - 1, steps))
    # The per-step LR schedule counts committed steps: a discarded step does not advance it (it ran one ahead).
    assert all(r["lr"] == pytest.approx(0.05 * lr_at(r["global_step"]), rel=1e-12) for r in survivor + healed)
    a, b = _weights(tmp_path / "0_run.pt"), _weights(tmp_path / "1_restart.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_a_lighthouse_address_nothing_listens_on_is_reported_within_the_connect_timeout(tmp_path: Path) -> None:
    # torchft applied TORCHFT_CONNECT_TIMEOUT_SEC to its recoveries only: the lighthouse connection waited out
    # the strategy's whole timeout (30 minutes by default) before saying the address was wrong.
    groups = Groups(tmp_path, f"http://127.0.0.1:{free_port()}")
    try:
        start = time.monotonic()
        proc = groups.start("0", "--steps", "2", TORCHFT_CONNECT_TIMEOUT_SEC="3")
        assert groups.wait(proc) == 1, groups.logs()
        assert time.monotonic() - start < 60, groups.logs()  # start-up, 3 s, and Python's exit
    finally:
        groups.close()
    assert "within timeout of 3s" in groups.logs(), groups.logs()


def test_a_group_that_starts_alone_says_so(tmp_path: Path, lighthouse: str) -> None:
    # A fresh group waits for the others at most the quorum timeout; one whose peers never start then commits its
    # first steps alone (on its shard only), and says so.
    groups = Groups(tmp_path, lighthouse)
    try:
        assert groups.wait(groups.start("0", "--steps", "2", TORCHFT_QUORUM_TIMEOUT_SEC="3")) == 0, groups.logs()
    finally:
        groups.close()
    assert "committed its first step with 1 of NUM_REPLICA_GROUPS=2 groups" in groups.logs()
    rows = _rows(tmp_path / "0_run.jsonl")
    assert [r["participants"] for r in rows] == [1, 1]


def test_groups_started_apart_wait_for_each_other(tmp_path: Path, lighthouse: str) -> None:
    # The lighthouse holds a quorum only for groups whose manager heartbeats: a group that reached its first step
    # before another had started trained alone until the late one healed from it (the docs' two-terminal recipe).
    groups = Groups(tmp_path, lighthouse)
    try:
        g0 = groups.start("0", "--steps", "3")
        deadline = time.monotonic() + TIMEOUT
        while not (tmp_path / "starting_0_run").exists() and g0.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # group 0 is at its first step; group 1 has not started
        g1 = groups.start("1", "--steps", "3")
        assert [groups.wait(g0), groups.wait(g1)] == [0, 0], groups.logs()
    finally:
        groups.close()
    assert "committed its first step with 1" not in groups.logs()
    for group in "01":
        assert [r["participants"] for r in _rows(tmp_path / f"{group}_run.jsonl")] == [2, 2, 2], groups.logs()


def test_two_groups_match_one_process_on_a_tied_hf_llama_with_a_frozen_norm(tmp_path: Path, lighthouse: str) -> None:
    """A transformers Llama (tied embeddings, the final norm frozen, dict batches with labels): the groups' mean loss
    is the one-process loss of the whole batch at every step, and the frozen norm stays as it was built."""
    rows0, rows1, rows_ref = _two_groups_against_one_process(tmp_path, lighthouse, model="llama_tied")
    for x, y, ref_row in zip(rows0, rows1, rows_ref, strict=True):
        assert x["participants"] == y["participants"] == 2
        assert abs((x["loss"] + y["loss"]) / 2 - ref_row["loss"]) < 1e-5
    weights = _weights(tmp_path / "0_run.pt")
    assert torch.equal(weights["model.model.norm.weight"], torch.ones(32))
    assert torch.equal(weights["model.lm_head.weight"], weights["model.model.embed_tokens.weight"])


def test_diloco_every_step_with_a_plain_outer_step_is_synchronous_data_parallelism(tmp_path: Path, lighthouse: str) -> None:
    """H=1, outer SGD with lr 1 and no momentum, inner SGD with momentum (linear in the gradient): each step's
    average of the groups' updates is the update of the averaged gradient, so the run is the one-process run."""
    diloco = ("--diloco-every", "1", "--outer-lr", "1.0", "--outer-momentum", "0.0")
    rows0, _, _ = _two_groups_against_one_process(tmp_path, lighthouse, *diloco)
    # torchft counts committed quorums: the one before the first step, then one sync per step.
    assert [r["step"] for r in rows0] == list(range(2, 8)) and all(r["participants"] == 2 for r in rows0)


def test_diloco_groups_part_between_syncs_and_meet_at_each(tmp_path: Path, lighthouse: str) -> None:
    """H=3 with the default outer optimizer (Nesterov SGD 0.7 / 0.9), each group of 2 ranks with ZeRO-3: the
    groups' weights differ after the inner steps and are equal, bit for bit, after every third step."""
    groups = Groups(tmp_path, lighthouse)
    try:
        g0 = groups.start("0", "--steps", "6", "--wait-ready", "1_run", "--diloco-every", "3", ranks=2, zero=3)
        g1 = groups.start("1", "--steps", "6", "--wait-ready", "0_run", "--diloco-every", "3", ranks=2, zero=3)
        assert [groups.wait(p) for p in (g0, g1)] == [0, 0], groups.logs()
    finally:
        groups.close()
    rows0, rows1 = (_rows(tmp_path / f"{g}_run.jsonl") for g in ("0", "1"))
    assert [r["global_step"] for r in rows0] == [r["global_step"] for r in rows1] == list(range(1, 7))
    for x, y in zip(rows0, rows1, strict=True):
        synced = x["global_step"] % 3 == 0
        assert (x["weights_sum"] == y["weights_sum"]) == synced, (x, y)
    assert rows0[-1]["step"] == rows1[-1]["step"] == 3  # torchft's count: the first quorum, then two syncs
    a, b = _weights(tmp_path / "0_run.pt"), _weights(tmp_path / "1_run.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_diloco_resumed_at_a_sync_step_goes_on_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """H=2 with the default outer Nesterov momentum: groups stopped after step 4 (a sync, checkpointed) and resumed
    to step 6 end where the uninterrupted groups end. Without the outer momentum in the checkpoint the resumed
    run restarted it from zero (0.07 off after the next sync)."""
    from torchft.coordination import LighthouseServer

    diloco = ("--diloco-every", "2")
    groups = Groups(tmp_path, "")
    servers = []
    try:
        for tag, steps, extra in (("full", "6", ()), ("run", "4", ("--checkpoint-every", "2")),
                                  ("resume", "6", ("--checkpoint-every", "2", "--resume"))):
            # Each phase its own lighthouse: no quorum state of the last phase's groups. No group dies here, so a
            # group is declared dead only after 30 s without a heartbeat (a loaded machine stalls a process for
            # seconds; the other group would then sync alone).
            servers.append(LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000,
                                            heartbeat_timeout_ms=30_000))
            groups.lighthouse = f"http://127.0.0.1:{servers[-1].address().rsplit(':', 1)[1]}"
            procs = [groups.start(g, "--steps", steps, "--wait-ready", f"{other}_{tag}", "--tag", tag, *diloco, *extra)
                     for g, other in (("0", "1"), ("1", "0"))]
            assert [groups.wait(p) for p in procs] == [0, 0], groups.logs()
    finally:
        groups.close()
        for server in servers:
            server.shutdown()
    assert "outer optimizer starts" not in groups.logs()
    for g in "01":
        assert [r["global_step"] for r in _rows(tmp_path / f"{g}_resume.jsonl")] == [5, 6]
    full, resumed = _weights(tmp_path / "0_full.pt"), _weights(tmp_path / "0_resume.pt")
    for k in full:
        torch.testing.assert_close(resumed[k], full[k], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(resumed[k], _weights(tmp_path / "1_resume.pt")[k], rtol=0, atol=0)


def test_a_group_restarted_into_running_diloco_is_refused_and_the_other_goes_on(tmp_path: Path, lighthouse: str) -> None:
    # The restarted group took part in the survivor's sync quorum and all-reduced its weights' checksum against the
    # survivor's pseudo-gradients: a native abort in gloo (size mismatch) instead of the documented refusal.
    steps = 12
    groups = Groups(tmp_path, lighthouse)
    try:
        # Group 0 waits after step 7 until the restarted group asks for its first quorum, then syncs at step 9.
        g0 = groups.start("0", "--steps", str(steps), "--wait-ready", "1_run", "--diloco-every", "3",
                          "--hold-at", "7", "--hold-for", "starting_1_restart")
        g1 = groups.start("1", "--steps", str(steps), "--wait-ready", "0_run", "--diloco-every", "3", "--kill-at", "4")
        assert groups.wait(g1) == -signal.SIGKILL, groups.logs()
        g1 = groups.start("1", "--steps", str(steps), "--tag", "restart", "--diloco-every", "3")
        assert groups.wait(g1) == 1, groups.logs()
        assert groups.wait(g0) == 0, groups.logs()
    finally:
        groups.close()
    logs = groups.logs()
    assert "could not join the DiLoCo replica groups at their first sync" in logs and "EnforceNotMet" not in logs, logs
    assert _rows(tmp_path / "0_run.jsonl")[-1]["global_step"] == steps


def test_three_groups_match_one_process_and_two_survive_a_third(tmp_path: Path, lighthouse: str) -> None:
    """Three groups of one rank: exact against one process while all live; group 2 is killed in step 4, and the
    other two lose no step, keep identical weights and train on as two."""
    steps, kill_at = 8, 3
    groups = Groups(tmp_path, lighthouse, num_groups=3)
    try:
        live = [groups.start(g, "--steps", str(steps), "--wait-ready", *(f"{o}_run" for o in "012" if o != g))
                for g in "01"]
        killed = groups.start("2", "--steps", str(steps), "--wait-ready", "0_run", "1_run", "--kill-at", str(kill_at))
        ref = groups.start("ref", "--steps", str(kill_at), "--batch", str(16 * 3), torchft=False)
        assert groups.wait(killed) == -signal.SIGKILL, groups.logs()
        assert [groups.wait(p) for p in (*live, ref)] == [0, 0, 0], groups.logs()
    finally:
        groups.close()
    rows0, rows1, rows_ref = (_rows(tmp_path / f"{g}_run.jsonl") for g in ("0", "1", "ref"))
    for g in (rows0, rows1):
        assert all(r["step"] == r["global_step"] for r in g) and sorted({r["step"] for r in g}) == list(range(1, steps + 1))
        assert g[-1]["committed"] == steps and g[-1]["uncommitted"] <= 1
        assert [r["participants"] for r in g[:kill_at]] == [3] * kill_at and g[-1]["participants"] == 2
    for x, y, ref_row in zip(rows0[:kill_at], rows1[:kill_at], rows_ref, strict=True):
        # a sum of ~300 fp32 weights: each within ~1e-7 of the one-process run
        assert abs(x["weights_sum"] - ref_row["weights_sum"]) < 1e-4 and x["weights_sum"] == y["weights_sum"]
    a, b = _weights(tmp_path / "0_run.pt"), _weights(tmp_path / "1_run.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


QUORUM_TIMEOUT = 20  # seconds a group waits for a quorum (TORCHFT_QUORUM_TIMEOUT_SEC; the strategy's `timeout`)


def _lighthouse() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lightning_llmpar.cli", "lighthouse", "--port", str(port),
                             "--heartbeat-timeout-ms", "3000"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The address line (stdout) and torchft's own "listening" line (stderr, merged here) come in either order.
    lines = [proc.stdout.readline()]
    if "TORCHFT_LIGHTHOUSE=" not in lines[0]:
        lines.append(proc.stdout.readline())
    assert "TORCHFT_LIGHTHOUSE=" in lines[-1], lines
    return proc, f"http://127.0.0.1:{port}"


def test_a_dead_lighthouse_stops_every_group_and_checkpoints_carry_the_run_on(tmp_path: Path) -> None:
    """Without the lighthouse no quorum can form. Each group must stop with an error that says so (neither hang
    nor loop over discarded steps) and commit no step after the lighthouse died. Checkpoints are the backstop:
    with a new lighthouse, both groups resume from their last FaultTolerantCheckpoint and end where one process
    training on every group's batches ends. (A group started afresh heals from a resumed one as from any other:
    the killed-group tests.)"""
    steps, hold_at = 8, 3
    lighthouse, address = _lighthouse()
    groups = Groups(tmp_path, address)
    timeout = {"TORCHFT_QUORUM_TIMEOUT_SEC": str(QUORUM_TIMEOUT)}
    try:
        procs = [groups.start(g, "--steps", str(steps), "--wait-ready", f"{other}_run", "--checkpoint-every",
                              str(hold_at), "--hold-at", str(hold_at), "--hold-for", "lighthouse_down", **timeout)
                 for g, other in (("0", "1"), ("1", "0"))]
        ref = groups.start("ref", "--steps", str(steps), "--batch", str(16 * 2), torchft=False)
        deadline = time.monotonic() + TIMEOUT
        while not all((tmp_path / f"held_{g}_run_0").exists() for g in "01"):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), groups.logs()
            time.sleep(0.1)
        lighthouse.kill()  # as a lost host would: no goodbye, open connections reset
        lighthouse.wait(timeout=60)
        down = time.monotonic()
        (tmp_path / "lighthouse_down").touch()
        codes = [groups.wait(p) for p in procs]
        stopped_after = time.monotonic() - down
        assert codes == [1, 1], groups.logs()
        assert stopped_after < QUORUM_TIMEOUT + 60, groups.logs()  # the quorum timeout, and Python's exit
        for log in ("0_0.log", "1_1.log"):  # the error names what failed and the way back
            assert f"the lighthouse at {address} is down" in (tmp_path / log).read_text(), groups.logs()

        lighthouse, groups.lighthouse = _lighthouse()
        resume = ["--checkpoint-every", str(hold_at), "--resume"]
        procs = [groups.start(g, "--steps", str(steps), "--wait-ready", f"{other}_resume", *resume, "--tag", "resume",
                              **timeout) for g, other in (("0", "1"), ("1", "0"))]
        assert [groups.wait(p) for p in (*procs, ref)] == [0, 0, 0], groups.logs()
    finally:
        groups.close()
        if lighthouse.poll() is None:
            lighthouse.kill()
    for g in "01":
        before, after = _rows(tmp_path / f"{g}_run.jsonl"), _rows(tmp_path / f"{g}_resume.jsonl")
        assert [r["global_step"] for r in before] == list(range(1, hold_at + 1))  # nothing after the lighthouse died
        assert [r["global_step"] for r in after] == list(range(hold_at + 1, steps + 1))
        assert all(r["participants"] == 2 for r in before + after)
    a, b, r = (_weights(tmp_path / f"{g}.pt") for g in ("0_resume", "1_resume", "ref_run"))
    for k in r:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
        torch.testing.assert_close(a[k], r[k], rtol=1e-5, atol=1e-5)
