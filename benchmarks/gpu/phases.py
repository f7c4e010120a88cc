"""Where a one-GPU step's memory peaks, and what is alive there: the eager 1.06B run of ``python -m benchmarks.gpu``
with and without last step's gradients held, and compiled.

    python -m benchmarks.gpu.phases          # on one H100/H200, under 2 minutes; writes results/gpu_phases.json

For one step it records the bytes allocated at each phase's end and the phase's peak (forward and loss, backward,
optimizer step), and, from the caching allocator's event history, the tensors alive at the step's peak grouped by
the line of Python that made them. These are what ``planner.memory`` counts term by term for one device.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

__all__ = ["PhaseRecorder", "live_at_peak", "main"]

OUT = Path(__file__).resolve().parents[1] / "results" / "gpu_phases.json"
GiB = 2**30
OURS = ("lightning_llmpar", "torch/nn/functional", "torch/optim")


class PhaseRecorder(Callback):
    """Allocated bytes at each phase's end and each phase's peak, every step; the live tensors at step ``traced``'s
    peak. It overrides no zero-grad hook, so the strategy still releases last step's gradients."""

    def __init__(self, traced: int = 3) -> None:
        self.traced, self.steps, self.at_peak = traced, [], None
        self._step: dict[str, dict[str, float]] = {}

    def _mark(self, phase: str) -> None:
        torch.cuda.synchronize()
        self._step[phase] = {"allocated_gib": torch.cuda.memory_allocated() / GiB,
                             "peak_gib": torch.cuda.max_memory_allocated() / GiB,
                             "reserved_gib": torch.cuda.memory_reserved() / GiB}
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._step, self._index = {}, batch_idx
        if batch_idx == self.traced:
            torch.cuda.memory._record_memory_history(max_entries=400_000)
        self._mark("start")  # last step's gradients are still on the parameters here

    def on_before_backward(self, *args: Any) -> None:
        self._mark("forward_and_loss")

    def on_after_backward(self, *args: Any) -> None:
        self._mark("backward")

    def on_train_batch_end(self, *args: Any) -> None:
        self._mark("optimizer_step")
        self.steps.append(self._step)
        if self._index == self.traced:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            self.at_peak = live_at_peak(snapshot["device_traces"][0])


def _site(frames: list[dict[str, Any]]) -> str:
    """The first frame in this package or torch's functional/optim code; what backward allocates has none."""
    for f in frames:
        if any(part in f["filename"] for part in OURS):
            return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}"
    return "backward (no Python frame)"


def live_at_peak(trace: list[dict[str, Any]]) -> dict[str, Any]:
    """Replay the allocator's events: the most bytes allocated beyond the trace's start, and the tensors alive then,
    summed by the site that made them."""
    level = best = 0
    best_at = -1
    for i, event in enumerate(trace):
        level += event["size"] if event["action"] == "alloc" else -event["size"] if event["action"] == "free_completed" else 0
        if level > best:
            best, best_at = level, i
    alive: dict[int, dict[str, Any]] = {}
    for event in trace[:best_at + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
        elif event["action"] == "free_completed":
            alive.pop(event["addr"], None)
    sizes: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for event in alive.values():
        site = _site(event.get("frames", []))
        sizes[site] += event["size"]
        counts[site] += 1
    return {"growth_gib": best / GiB, "made_by": _site(trace[best_at].get("frames", [])) if best_at >= 0 else None,
            "alive": [{"site": s, "gib": n / GiB, "tensors": counts[s]} for s, n in sizes.most_common(30)]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.phases", description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks.gpu.phases needs a CUDA GPU (it reads the caching allocator).")
    from benchmarks.gpu.run import MODEL_1B
    from benchmarks.gpu.train import train

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": {}}
    for name, kw in (("bf16_1b", {}), ("bf16_1b_previous_grads_held", {"holds_previous_grads": True}),
                     ("bf16_1b_compile", {"compile": True})):
        recorder = PhaseRecorder()
        measured = train(MODEL_1B, accelerator="cuda", steps=5, batch=8, callbacks=(recorder,), **kw)
        report["runs"][name] = {"phases": recorder.steps, "at_peak": recorder.at_peak,
                                "peak_reserved_gib": measured["peak_reserved_gib"]}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(name, json.dumps(recorder.steps[-1]), flush=True)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
