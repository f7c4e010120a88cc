"""Parity self-check: run your own module and data for a few steps in one process and under your layout, on the
same global batches, and compare losses, gradient norms and gradients.

A layout that is silently wrong for a model (a parameter whose gradient is not reduced, an attention that
reads the sequence length of sequence-sharded activations, a tie split apart) shows as a loss or gradient that
differs from one process's, named by its parameter. Every run uses plain SGD, because an adaptive optimizer
hides a constant gradient-scale error.

Python: ``lightning_llmpar.verify_parity(MyModule, MyData, {"tensor_parallel": 2}, devices=2)``;
command line: ``llmpar verify --config my.yaml`` (the model, data and strategy of a ``llmpar fit`` config).
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_llmpar.launch import run_ranks
from lightning_llmpar.training.batches import batch_size

__all__ = ["ParityReport", "verify_parity"]


@dataclass
class ParityReport:
    losses: list[tuple[float, float]]  # (one process, layout) per step
    grad_norms: list[tuple[float, float]]
    worst_parameter: tuple[str, float] | None  # first-step gradient differing most, relative to its norm
    first_differing: str | None  # first parameter (in module order) whose gradient differs beyond the tolerance
    tolerance: float
    layout: str
    rows: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        rel = [_rel(a, b) for pair in (self.losses, self.grad_norms) for a, b in pair]
        return self.first_differing is None and all(r <= self.tolerance for r in rel)

    def __str__(self) -> str:
        lines = [f"parity check: one process vs {self.layout} (SGD, tolerance {self.tolerance:g} relative)",
                 f"{'step':>4}  {'loss (1 proc)':>14} {'loss (layout)':>14} {'rel diff':>9}  {'grad-norm rel diff':>18}"]
        for i, ((l1, l2), (g1, g2)) in enumerate(zip(self.losses, self.grad_norms)):
            lines.append(f"{i:>4}  {l1:>14.6f} {l2:>14.6f} {_rel(l1, l2):>9.2e}  {_rel(g1, g2):>18.2e}")
        if self.worst_parameter is not None:
            lines.append(f"largest first-step gradient difference: {self.worst_parameter[0]} ({self.worst_parameter[1]:.2e} of its norm)")
        if self.first_differing is not None:
            lines.append(f"first parameter whose gradient differs: {self.first_differing}")
        lines.append("PASS" if self.passed else "FAIL: this layout does not reproduce one process for this model")
        return "\n".join(lines)


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), 1e-12)


def _load(spec: Any) -> Any:
    """A class, or its import path ('pkg.mod.Class')."""
    if isinstance(spec, str):
        module, _, name = spec.rpartition(".")
        return getattr(importlib.import_module(module), name)
    return spec


def _spec(obj: Any) -> Any:
    return f"{obj.__module__}.{obj.__qualname__}" if isinstance(obj, type) else obj


def _global_batches(data: Any, data_kwargs: dict[str, Any], steps: int) -> list[Any]:
    datamodule = _load(data)(**data_kwargs)
    datamodule.setup("fit")
    batches = []
    for batch in datamodule.train_dataloader():
        batches.append(batch)
        if len(batches) == steps:
            break
    if len(batches) < steps:
        raise ValueError(f"The training data gives {len(batches)} batches; the check needs steps={steps}.")
    return batches


def _shard(batch: Any, rank: int, ranks: int) -> Any:
    """This data-parallel rank's rows of a global batch (every tensor split along dim 0)."""
    def take(t: Any) -> Any:
        if isinstance(t, Tensor) and t.dim() > 0:
            if t.shape[0] % ranks:
                raise ValueError(f"A global batch of {t.shape[0]} samples does not split over {ranks} data-parallel ranks.")
            step = t.shape[0] // ranks
            return t[rank * step : (rank + 1) * step]
        return t

    return torch.utils._pytree.tree_map(take, batch)


class _Batches:
    """A fixed sequence of batches as a data loader (a plain list would be read as a list of loaders)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches
        # What the strategy reads of a DataLoader to check the batches before the first step (that the pipeline's
        # microbatches divide them, as `llmpar fit` checks its loaders): every batch has the first one's size.
        self.batch_size = batch_size(batches[0]) if batches else None
        self.sampler, self.drop_last = range(len(batches) * (self.batch_size or 0)), True

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    """One run (one process, or this rank of the layout): losses, grad norms, first-step full gradients on rank 0."""
    from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything

    from lightning_llmpar.strategies.llm_parallel import LLMParallelStrategy
    from lightning_llmpar.training.clip import stages_of, total_grad_norm

    seed_everything(spec["seed"], verbose=False)
    module = _load(spec["model"])(**spec["model_kwargs"])
    lr = spec["lr"]
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=lr)  # type: ignore[method-assign]
    batches = spec["batches"]

    class _Data(LightningDataModule):
        def train_dataloader(self) -> Any:
            kwargs = self.trainer.strategy.distributed_sampler_kwargs if spec["strategy"] is not None else {}
            ranks, rank = kwargs.get("num_replicas", 1), kwargs.get("rank", 0)
            return _Batches([_shard(b, rank, ranks) for b in batches])

    report: dict[str, Any] = {"losses": [], "norms": [], "grads": {}}

    class _Record(Callback):
        def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            # The strategy's loss of the global batch, weighed as training weighs it (context-parallel shares,
            # loss_normalization='tokens'); a plain mean over the ranks is not that.
            global_loss = getattr(trainer.strategy, "batch_loss", None)
            report["losses"].append(float((global_loss if global_loss is not None else loss).detach()))

        def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
            strategy = trainer.strategy
            group, skip = stages_of(strategy)
            params = [p for p in pl_module.parameters() if p.grad is not None]
            report["norms"].append(float(total_grad_norm(params, 2.0, group, skip, pl_module.device)))
            if len(report["norms"]) == 1:  # the first step (every rank takes part; rank 0 keeps the result)
                report["grads"] = _first_step_grads(pl_module, strategy, spec["strategy"] is not None)

    devices = 1 if spec["strategy"] is None else int(os.environ["WORLD_SIZE"])
    trainer = Trainer(
        accelerator=spec["accelerator"], devices=devices,
        strategy="auto" if spec["strategy"] is None else LLMParallelStrategy(**spec["strategy"]),
        max_steps=len(batches), logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[_Record()],
    )
    trainer.fit(module, datamodule=_Data())
    report["layout"] = str(getattr(trainer.strategy, "layout", "one process"))
    return report


def _first_step_grads(module: Any, strategy: Any, distributed: bool) -> dict[str, Tensor]:
    """Full gradients named as in one process, on global rank 0 (collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    from lightning_llmpar.modeling.packing import to_canonical

    packings = getattr(strategy, "packings", {}) if distributed else {}
    aliases = getattr(strategy, "tied_aliases", {}) if distributed else {}
    grads: dict[str, Tensor] = {}
    for name, p in module.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if name in packings:
            grad = to_canonical(grad, packings[name])
        grads.setdefault(aliases.get(name, name), grad.detach().float().cpu())
    if not distributed:
        return grads
    from lightning_llmpar.checkpointing.hf_checkpoint import _gather_stages

    merged = _gather_stages(strategy, grads)
    return merged if dist.get_rank() == 0 else {}


def _launch(spec: dict[str, Any], devices: int) -> dict[str, Any]:
    """Rank 0's result of ``_run(spec)`` on ``devices`` ranks (the package's launcher, as the tests use it)."""
    return run_ranks(_run, devices, spec, timeout=1800, threads=max(1, (os.cpu_count() or 1) // devices))[0]


def verify_parity(
    model: Any,
    data: Any,
    strategy: dict[str, Any],
    devices: int,
    *,
    model_kwargs: dict[str, Any] | None = None,
    data_kwargs: dict[str, Any] | None = None,
    steps: int = 5,
    lr: float = 1e-2,
    tolerance: float = 1e-4,
    accelerator: str = "cpu",
    seed: int = 1234,
    verbose: bool = True,
) -> ParityReport:
    """Train ``model`` (a LightningModule class or import path) on the first ``steps`` batches of ``data`` (a
    LightningDataModule class or path) in one process and with ``LLMParallelStrategy(**strategy)`` on
    ``devices`` processes; the layout's data-parallel ranks split each global batch between them.

    Returns the report (``report.passed``; ``print(report)`` shows per-step relative loss and gradient-norm
    differences and the first parameter whose gradient differs). The global batch must divide into the
    data-parallel ranks (and pipeline microbatches); fp32 parity is within about 1e-5.
    """
    batches = _global_batches(data, data_kwargs or {}, steps)
    spec = {"model": _spec(model), "model_kwargs": model_kwargs or {}, "batches": batches, "lr": lr, "seed": seed,
            "accelerator": accelerator, "strategy": None}
    reference = _launch(spec, 1)
    layout = _launch({**spec, "strategy": dict(strategy)}, devices)
    worst: tuple[str, float] | None = None
    first: str | None = None
    for name, ref in reference["grads"].items():
        ours = layout["grads"].get(name)
        if ours is None or ours.shape != ref.shape:
            first = first or name
            continue
        rel = float((ours - ref).norm() / max(float(ref.norm()), 1e-12))
        if worst is None or rel > worst[1]:
            worst = (name, rel)
        if rel > tolerance and first is None:
            first = name
    report = ParityReport(
        losses=list(zip(reference["losses"], layout["losses"])),
        grad_norms=list(zip(reference["norms"], layout["norms"])),
        worst_parameter=worst, first_differing=first, tolerance=tolerance, layout=layout["layout"],
    )
    if verbose:
        print(report)
    return report
