"""Every layout that can run a model on a cluster, predicted and ranked; the best written as a `llmpar fit` config."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_llmpar.planner.candidate import CHECKPOINTING, Candidate
from lightning_llmpar.planner.cluster import PRECISIONS, Cluster, Precision, cluster_from
from lightning_llmpar.planner.config import check_writable, fit_config, source_sections
from lightning_llmpar.planner.memory import MemoryEstimate, gib_text, predict_memory
from lightning_llmpar.planner.spec import ModelSpec, model_spec
from lightning_llmpar.planner.speed import TimeEstimate, predict_step_time

__all__ = ["Plan", "PlannedLayout", "candidates", "plan"]

GiB = 2**30


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_search(search: dict[str, Any]) -> None:
    """The ``candidates`` arguments ``plan`` passes on, checked before any layout is predicted."""
    allowed = {"zero_stages": (0, 1, 2, 3), "checkpointing": CHECKPOINTING}
    unknown = sorted(set(search) - {*allowed, "context_parallel", "max_micro_batch"})
    if unknown:
        raise ValueError(f"plan() takes no {', '.join(unknown)}; the search takes zero_stages, checkpointing,"
                         " context_parallel and max_micro_batch.")
    for name, choices in allowed.items():
        bad = [v for v in search.get(name, ()) if v not in choices or isinstance(v, bool)]
        if isinstance(search.get(name, ()), str) or bad:
            raise ValueError(f"`{name}` must be a sequence of values from {list(choices)}, got {search[name]!r}.")
    cp = search.get("context_parallel")
    if cp is not None and (isinstance(cp, str) or not all(_positive_int(c) for c in cp)):
        raise ValueError(f"`context_parallel` must be a sequence of positive integers (degrees to try), got {cp!r}.")
    if "max_micro_batch" in search and not _positive_int(search["max_micro_batch"]):
        raise ValueError(f"`max_micro_batch` must be a positive integer, got {search['max_micro_batch']!r}.")


@dataclass(frozen=True)
class PlannedLayout:
    candidate: Candidate
    memory: MemoryEstimate
    time: TimeEstimate
    fits: bool

    def as_dict(self) -> dict[str, Any]:
        return {"layout": self.candidate.label(), "candidate": dict(self.candidate.__dict__), "fits": self.fits,
                "memory_gib": {k: v / GiB if k != "rank" else v for k, v in self.memory.as_dict().items()},
                "time_s": self.time.as_dict()}


def _divisors(n: int, most: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (most is None or d <= most)]


def _pipeline_options(spec: ModelSpec, pp: int, microbatches: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("none", 1)]
    if microbatches < pp or spec.n_layer < pp:
        return []
    options = [("1F1B", 1)]
    rounds = max(1, microbatches // pp)
    if spec.n_layer >= 2 * pp and microbatches % rounds == 0:
        options.append(("Interleaved1F1B", 2))
    return options


def candidates(
    spec: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    seq: int,
    *,
    zero_stages: Sequence[int] = (0, 2, 3),
    checkpointing: Sequence[str] = CHECKPOINTING,
    context_parallel: Sequence[int] | None = None,
    max_micro_batch: int = 16,
) -> Iterator[Candidate]:
    """Layouts the strategy accepts for ``spec`` on all of ``cluster``'s devices. ZeRO-1 runs as ZeRO-2 on FSDP2,
    so it is not searched separately; tensor parallelism stays inside a node and splits heads evenly; context
    parallelism is searched for sequences of 8192 tokens and more."""
    world = cluster.world_size
    if context_parallel is None:
        context_parallel = [1, 2, 4, 8] if seq >= 8192 else [1]
    for tp in _divisors(world, min(cluster.gpus_per_node, 8)):
        # Key/value heads fewer than the ranks are shared by them (a degree they divide); any other count is refused.
        if spec.n_head % tp or (spec.n_kv_head % tp and tp % spec.n_kv_head) or spec.ffn_hidden % tp:
            continue
        for cp in context_parallel:
            if (cp > 1 and seq % (2 * cp)) or world % (tp * cp):
                continue
            for pp in _divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    continue
                yield from _at(spec, cluster, global_batch // dp, dict(tp=tp, cp=cp, pp=pp, dp=dp), zero_stages,
                               checkpointing, max_micro_batch)


def _at(spec: ModelSpec, cluster: Cluster, local: int, degrees: dict[str, int], zero_stages: Sequence[int],
        checkpointing: Sequence[str], max_micro_batch: int) -> Iterator[Candidate]:
    dp, cp = degrees["dp"], degrees["cp"]
    for zero in zero_stages if dp * cp > 1 else (0,):
        replicas = [dp] if zero == 0 else [1] + ([cluster.nodes] if 1 < cluster.nodes < dp and dp % cluster.nodes == 0
                                                 else [])
        for dp_replicate in replicas:
            shard_axis = dp // dp_replicate if zero else dp
            eps = [e for e in _divisors(shard_axis, 8) if spec.n_expert and spec.n_expert % e == 0] or [1]
            for ep in eps:
                for mb in _divisors(local, max_micro_batch):
                    for schedule, virtual in _pipeline_options(spec, degrees["pp"], local // mb):
                        for mode in checkpointing:
                            yield Candidate(**degrees, ep=ep, dp_replicate=dp_replicate, zero=zero,
                                            checkpointing=mode, micro_batch=mb, microbatches=local // mb,
                                            schedule=schedule, virtual=virtual)  # type: ignore[arg-type]


@dataclass
class Plan:
    """Predicted layouts, fastest first among those that fit (then the rest, smallest peak first)."""

    spec: ModelSpec
    cluster: Cluster
    precision: Precision
    global_batch: int
    seq: int
    layouts: list[PlannedLayout] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)  # a source `llmpar fit` YAML's other sections

    @property
    def best(self) -> PlannedLayout | None:
        return self.layouts[0] if self.layouts and self.layouts[0].fits else None

    def table(self, top: int = 10) -> str:
        lines = [f"{self.spec.name}: {self.spec.params / 1e6:.1f}M parameters; {self.cluster.nodes} node(s) x"
                 f" {self.cluster.gpus_per_node} {self.cluster.device} ({self.cluster.memory_gb:g} GB);"
                 f" global batch {self.global_batch} x {self.seq} tokens; {self.precision.name}",
                 f"{'#':>3}  {'layout':<58} {'peak GiB':>9} {'step s':>9} {'tok/s':>10} {'MFU':>6}  fits"]
        for i, row in enumerate(self.layouts[:top], 1):
            lines.append(f"{i:>3}  {row.candidate.label():<58} {gib_text(row.memory.peak):>9} {row.time.step:>9.4f}"
                         f" {row.time.tokens_per_s:>10.0f} {row.time.mfu:>6.1%}  {'yes' if row.fits else 'NO'}")
        fitting = sum(r.fits for r in self.layouts)
        lines.append(f"{fitting} of {len(self.layouts)} layouts fit.")
        return "\n".join(lines)

    def as_dict(self, top: int | None = None) -> dict[str, Any]:
        return {"model": {"name": self.spec.name, "parameters": self.spec.params},
                "cluster": dict(self.cluster.__dict__), "precision": self.precision.name,
                "global_batch": self.global_batch, "seq": self.seq,
                "layouts": [row.as_dict() for row in self.layouts[:top]]}

    def to_json(self, top: int | None = None) -> str:
        return json.dumps(self.as_dict(top), indent=2)

    def write_config(self, path: str | Path, row: PlannedLayout | None = None) -> Path:
        """Write ``row`` (default: the best layout) as a config `llmpar fit --config` takes. An existing file is
        replaced only if `llmpar plan` wrote it."""

        row = row or self.best
        if row is None:
            raise ValueError(
                f"No layout of {self.spec.name} fits {self.cluster.memory_gb:g} GB per device at global batch"
                f" {self.global_batch} x {self.seq}: use more devices or memory, or a smaller batch or sequence."
            )
        path = check_writable(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fit_config(self, row))
        return path


def plan(
    model: str | Path | dict[str, Any] | ModelSpec,
    cluster: str | Cluster = "h100",
    *,
    global_batch: int,
    seq: int,
    precision: str = "bf16-mixed",
    headroom: float = 0.1,
    compile: bool = False,
    float8: str | None = None,
    async_tp: bool = False,
    **search: Any,
) -> Plan:
    """Predict every layout of ``model`` on ``cluster`` and rank them (see ``candidates`` for ``search``).

    ``compile``: blocks compiled with torch.compile; ``float8``: the blocks' linears in torchao float8
    ('tensorwise', with FP8 all-gather under FSDP, or 'rowwise', without tensor parallelism; ``precision='fp8'`` means
    'tensorwise');
    ``async_tp``: tensor-parallel collectives overlapped with their matmuls. A layout fits when its predicted
    peak leaves ``headroom`` of the device's memory free (the runtime's own buffers)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {sorted(PRECISIONS)}.")
    if float8 not in (None, "tensorwise", "rowwise"):
        raise ValueError(f"float8={float8!r}: choose 'tensorwise', 'rowwise' or None.")
    if float8 and precision == "32-true":
        raise ValueError(f"float8={float8!r} runs with bf16 around the fp8 matmuls: use precision='bf16-mixed'.")
    if precision == "fp8":
        float8 = float8 or "tensorwise"
    elif float8:
        precision = "fp8"
    for name, value in (("global_batch", global_batch), ("seq", seq)):
        if not _positive_int(value):
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise ValueError(f"`headroom` is a fraction of device memory in [0, 1), got {headroom!r}.")
    for name, flag in (("compile", compile), ("async_tp", async_tp)):
        if not isinstance(flag, bool):
            raise ValueError(f"`{name}` must be True or False, got {flag!r}.")
    _check_search(search)
    spec = model if isinstance(model, ModelSpec) else model_spec(model)
    if spec.max_seq and seq > spec.max_seq:  # the model would refuse it at its first forward
        raise ValueError(f"seq={seq} is longer than {spec.name} accepts (block_size {spec.max_seq}): plan with a"
                         f" seq of at most {spec.max_seq}, or raise the model's block_size.")
    cluster = cluster_from(cluster)
    p = PRECISIONS[precision]
    budget = cluster.memory_gb * 1e9 * (1 - headroom)
    rows = []
    for c in candidates(spec, cluster, global_batch, seq, **search):
        if float8 == "rowwise" and c.tp > 1:  # the strategy refuses it: rowwise scales over a split dimension
            continue
        c = replace(c, compile=compile, float8=float8, async_tp=async_tp and c.tp > 1)  # type: ignore[arg-type]
        memory = predict_memory(spec, c, seq, p, cluster.caching_allocator)
        rows.append(PlannedLayout(c, memory, predict_step_time(spec, c, seq, cluster, p), memory.peak <= budget))
    if not rows:
        cp = search.get("context_parallel") or [1]
        if all(c > 1 and (seq % (2 * c) or cluster.world_size % c) for c in cp):
            raise ValueError(f"No layout of {spec.name}: context_parallel={list(cp)} must divide the"
                             f" {cluster.world_size} devices and half the sequence ({seq // 2} tokens).")
        raise ValueError(
            f"No layout of {spec.name} divides {cluster.world_size} devices and global batch {global_batch}: choose a"
            f" global batch divisible by the data-parallel degrees the device count allows (a multiple of"
            f" {cluster.world_size} runs data parallel on every device)."
        )
    rows.sort(key=lambda r: (not r.fits, r.time.step if r.fits else r.memory.peak, r.memory.peak))
    return Plan(spec, cluster, p, global_batch, seq, rows, source_sections(model))
