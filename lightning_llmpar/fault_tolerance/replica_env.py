"""What one replica group is told: its place among the groups (the environment) and the strategy arguments that go
with ``fault_tolerance``. Both checked when the strategy is made, before any process does work."""

from __future__ import annotations

import importlib.util
import os
import urllib.parse
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["ReplicaGroupEnv", "check_fault_tolerance"]

FAULT_TOLERANCE = ("torchft",)
ENV_REPLICA_ID, ENV_NUM_GROUPS, ENV_LIGHTHOUSE = "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"
# torchft's own timeouts, each over the strategy's `timeout` where set; torchft reads them as whole seconds.
ENV_TIMEOUTS = ("TORCHFT_TIMEOUT_SEC", "TORCHFT_QUORUM_TIMEOUT_SEC", "TORCHFT_CONNECT_TIMEOUT_SEC")


@dataclass(frozen=True)
class ReplicaGroupEnv:
    """Which replica group this job is, of how many, and where the lighthouse listens (from the environment)."""

    replica_id: int
    num_groups: int
    lighthouse: str
    # TORCHFT_CONNECT_TIMEOUT_SEC: torchft applies it to its recoveries only, not to its connection to the
    # lighthouse, which then took the whole strategy timeout to report a wrong address; the strategy passes it on.
    connect_timeout: timedelta | None = None

    @classmethod
    def from_env(cls) -> ReplicaGroupEnv:
        missing = [k for k in (ENV_REPLICA_ID, ENV_NUM_GROUPS, ENV_LIGHTHOUSE) if not os.environ.get(k)]
        if missing:
            raise ValueError(
                f"fault_tolerance='torchft' needs {', '.join(missing)} in the environment: each replica group is its"
                f" own job, started with {ENV_REPLICA_ID}=<0..G-1> {ENV_NUM_GROUPS}=<G> {ENV_LIGHTHOUSE}=http://<host>:<port>"
                " (the address `llmpar lighthouse` or `torchft_lighthouse` prints)."
            )
        try:
            rid, num = int(os.environ[ENV_REPLICA_ID]), int(os.environ[ENV_NUM_GROUPS])
        except ValueError:
            raise ValueError(f"{ENV_REPLICA_ID}={os.environ[ENV_REPLICA_ID]!r} and {ENV_NUM_GROUPS}="
                             f"{os.environ[ENV_NUM_GROUPS]!r} must be integers.") from None
        if not 0 <= rid < num:
            raise ValueError(f"{ENV_REPLICA_ID}={rid} must be in [0, {ENV_NUM_GROUPS}={num}).")
        address = urllib.parse.urlsplit(os.environ[ENV_LIGHTHOUSE])  # torchft waits out its whole timeout on a malformed one
        if address.scheme not in ("http", "https") or not address.hostname or address.port is None:
            raise ValueError(f"{ENV_LIGHTHOUSE}={os.environ[ENV_LIGHTHOUSE]!r} is not an address http://<host>:<port>"
                             " (as `llmpar lighthouse` prints it).")
        for name in ENV_TIMEOUTS:
            value = os.environ.get(name)
            if value is not None and not (value.isdigit() and int(value) > 0):
                raise ValueError(f"{name}={value!r} must be a positive whole number of seconds (torchft reads it so).")
        connect = os.environ.get(ENV_TIMEOUTS[2])
        return cls(rid, num, os.environ[ENV_LIGHTHOUSE], timedelta(seconds=int(connect)) if connect else None)


def check_fault_tolerance(a: dict[str, Any]) -> str | None:
    """Check ``fault_tolerance`` against the other strategy arguments ``a``; what has not been tested is refused."""
    ft = a["fault_tolerance"]
    if ft is None:
        return None
    if ft not in FAULT_TOLERANCE:
        raise ValueError(f"`fault_tolerance` must be None or one of {FAULT_TOLERANCE}, got {ft!r}.")
    untested = {
        "pipeline_parallel": a["pipeline_parallel"] != 1, "tensor_parallel": a["tensor_parallel"] != 1,
        "context_parallel": a["context_parallel"] != 1, "expert_parallel": a["expert_parallel"] != 1,
        "data_parallel_replicate": a["data_parallel_replicate"] not in ("auto", 1),
        "sharding_backend": a["sharding_backend"] != "fsdp2", "gradient_compression": a["gradient_compression"] is not None,
        "loss_normalization": a["loss_normalization"] != "mean",
    }
    given = sorted(k for k, v in untested.items() if v)
    if given:
        raise ValueError(
            f"fault_tolerance='torchft' supports data parallelism (plain or ZeRO with the fsdp2 backend) inside each"
            f" replica group; {', '.join(f'{k}={a[k]!r}' for k in given)} is not supported with it yet. The replica"
            " groups themselves are the replicate axis: leave data_parallel_replicate at 'auto'."
        )
    if importlib.util.find_spec("torchft") is None:
        raise ValueError("fault_tolerance='torchft' needs the torchft package: pip install 'lightning_llmpar[ft]'.")
    ReplicaGroupEnv.from_env()
    return ft
