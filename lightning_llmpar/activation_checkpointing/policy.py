"""Activation checkpointing per block: full, every k-th block, op-level selective, or fitted to a budget.

Configured as a callback (so it fits in a LightningCLI YAML) but applied by the strategy between
tensor parallelism and FSDP: Lightning has no hook between ``configure_model`` and sharding, and
recomputation must replay the tensor-parallel ops while FSDP's hooks stay outside it. Blocks keep their
names: the block's ``forward`` is wrapped in place instead of wrapping the module. Every choice is per
block and only decides what is kept or recomputed, so gradients are those of training without it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_llmpar.activation_checkpointing.memory import held_activation_bytes
from lightning_llmpar.modeling.structure import find_block_stack
from lightning_llmpar.training.documents import hook_models_with_cache

__all__ = [
    "ActivationCheckpointing",
    "BlockPlanner",
    "CheckpointPlan",
    "apply_activation_checkpointing",
    "choose_modes",
    "saved_activation_bytes",
    "wrap_blocks",
]

log = logging.getLogger(__name__)

Mode = Literal["none", "full", "every_k", "selective", "budget"]
Save = Literal["attention", "attention_and_matmuls", "attention_and_up_projections"]
BlockMode = Literal["none", "selective", "full"]
_BLOCK_MODES: tuple[BlockMode, ...] = ("none", "selective", "full")  # least recompute first

_ATTENTION = {
    name
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
}
_MATMUL = {"mm", "addmm", "bmm", "linear"}


@dataclass(frozen=True)
class CheckpointPlan:
    mode: Mode = "none"
    every: int = 2
    save: Save = "attention"
    budget_mb: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in get_args(Mode):
            raise ValueError(f"activation checkpointing mode={self.mode!r} is not one of {get_args(Mode)}.")
        if self.save not in get_args(Save):
            raise ValueError(f"activation checkpointing save={self.save!r} is not one of {get_args(Save)}.")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"activation checkpointing every={self.every!r} must be a whole number of blocks, at least 1.")
        if self.mode == "budget" and (self.budget_mb is None or self.budget_mb <= 0):
            raise ValueError(
                f"activation checkpointing mode='budget' needs budget_mb > 0 (got {self.budget_mb}): the activation"
                " memory (MiB) one forward of this rank's blocks may keep for backward."
            )
        if self.mode != "budget" and self.budget_mb is not None:
            raise ValueError(
                f"activation checkpointing budget_mb={self.budget_mb} is only read by mode='budget' (got"
                f" mode={self.mode!r}); set mode='budget' or drop budget_mb."
            )


def _matmul_widens(name: str, args: tuple[Any, ...]) -> bool:
    # mm(a, b) / bmm(a, b) / addmm(bias, a, b) with b (k, n), or linear(x, weight (n, k)): wider when n > k.
    if name == "linear":
        return args[1].shape[0] > args[0].shape[-1]
    a, b = (args[1], args[2]) if name == "addmm" else (args[0], args[1])
    return b.shape[-1] > a.shape[-1]


def _policy(save: Save) -> Any:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = getattr(op, "__name__", str(op)).split(".")[0]
        if name in _ATTENTION:
            keep = True
        elif name in _MATMUL and save != "attention":
            # Every projection costs the same FLOPs per output byte (2k per element for an inner size k).
            # The widening ones (an MLP's gate/up or fc1) hold most of a block's matmul FLOPs and bytes,
            # and saving them leaves the MLP's recompute elementwise; the narrow ones (q/k/v/o, down) are
            # cheap to redo and their outputs would only add bytes.
            keep = save == "attention_and_matmuls" or _matmul_widens(name, args)
        else:
            keep = False
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _run(forward: Any, mode: BlockMode, save: Save, *args: Any, **kwargs: Any) -> Any:
    if mode == "none":
        return forward(*args, **kwargs)
    if mode == "selective":
        context = partial(create_selective_checkpoint_contexts, _policy(save))
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _fixed_modes(plan: CheckpointPlan, num_blocks: int) -> list[BlockMode]:
    if plan.mode == "every_k":
        return ["none" if index % plan.every else "full" for index in range(num_blocks)]
    return ["none" if plan.mode == "none" else "selective" if plan.mode == "selective" else "full"] * num_blocks


class BlockPlanner:
    """Runs each block under its mode and, at the block's first forward with grad, measures the bytes it
    keeps for backward (with the real input, see ``held_activation_bytes``).

    With ``plan.mode == 'budget'`` it measures each block under none / selective / full while running it
    under full (the least memory), then, once every block is measured, picks per block the least
    recompute that fits ``budget_mb``: selective on more and more blocks before full on any. The
    measurements are first reduced (max) over ``groups`` so every rank that runs the same blocks in
    lockstep (data and tensor parallel peers) takes the same decision, as recomputed collectives require.
    """

    def __init__(self, names: list[str], plan: CheckpointPlan, groups: list[dist.ProcessGroup]) -> None:
        self.names, self.plan, self.groups = names, plan, groups
        self.budget = plan.mode == "budget"
        self.modes: list[BlockMode] | None = None if self.budget else _fixed_modes(plan, len(names))
        self.measured: list[dict[str, int] | None] = [None] * len(names)
        self.report: list[dict[str, Any]] | None = None

    def forward(self, index: int, forward: Any, *args: Any, **kwargs: Any) -> Any:
        if self.measured[index] is None and torch.is_grad_enabled() and not _on_meta(args, kwargs):
            candidates = _BLOCK_MODES if self.budget else (self.modes[index],)  # type: ignore[index]
            self.measured[index] = {
                m: held_activation_bytes(partial(_run, forward, m, self.plan.save), *args, **kwargs) for m in candidates
            }
            if all(m is not None for m in self.measured):
                self._finish()
        if self.modes is None:  # budget not decided yet: full recompute keeps the least
            return _run(forward, "full", self.plan.save, *args, **kwargs) if torch.is_grad_enabled() else forward(*args, **kwargs)
        return _run(forward, self.modes[index], self.plan.save, *args, **kwargs)

    def _finish(self) -> None:
        measured: list[dict[str, int]] = self.measured  # type: ignore[assignment]
        if self.budget:
            table = torch.tensor([[m[k] for k in _BLOCK_MODES] for m in measured], dtype=torch.int64)
            for group in self.groups:
                dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
            measured = [dict(zip(_BLOCK_MODES, row)) for row in table.tolist()]
            self.measured = measured  # type: ignore[assignment]
            self.modes = choose_modes(measured, self.plan.budget_mb)  # type: ignore[arg-type]
        modes = self.modes
        assert modes is not None
        self.report = [
            {"block": name, "mode": mode, "bytes": m[mode], "measured": m}
            for name, mode, m in zip(self.names, modes, measured)
        ]
        total = sum(r["bytes"] for r in self.report)
        log.info(
            "activation checkpointing (%s): %s; %.1f MiB kept for backward per forward of %d blocks",
            self.plan.mode, ", ".join(f"{r['block']}={r['mode']}" for r in self.report), total / 2**20, len(modes),
        )


def _on_meta(args: Any, kwargs: Any) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in (*args, *kwargs.values()))


def choose_modes(measured: list[dict[str, int]], budget_mb: float) -> list[BlockMode]:
    """Least recompute that fits: move blocks from none to selective one by one, then to full."""
    budget = budget_mb * 2**20
    modes: list[BlockMode] = ["none"] * len(measured)
    total = sum(m["none"] for m in measured)
    for target in ("selective", "full"):
        for index, m in enumerate(measured):
            if total <= budget:
                return modes
            total += m[target] - m[modes[index]]
            modes[index] = target  # type: ignore[assignment]
    if total > budget:
        least = sum(m["full"] for m in measured) / 2**20
        raise ValueError(
            f"Activation memory budget_mb={budget_mb} cannot be met: even full recompute of all {len(measured)}"
            f" blocks keeps {least:.3g} MiB (their inputs) for one forward. Set budget_mb >= {least:.3g}, or"
            " shrink what each rank holds: a smaller batch or sequence, more tensor or pipeline parallelism."
        )
    return modes


def wrap_blocks(
    blocks: list[nn.Module],
    plan: CheckpointPlan,
    names: list[str] | None = None,
    groups: list[dist.ProcessGroup] | None = None,
    measure: bool = False,
) -> BlockPlanner | None:
    """Wrap the blocks' ``forward``; returns the planner that measures and reports (None when nothing
    is measured: fixed modes then wrap only the recomputed blocks, with no per-call bookkeeping)."""
    names = names or [str(i) for i in range(len(blocks))]
    if not measure and plan.mode != "budget":
        for block, mode in zip(blocks, _fixed_modes(plan, len(blocks))):
            if mode != "none":
                block.forward = partial(_run, block.forward, mode, plan.save)  # type: ignore[method-assign]
        return None
    planner = BlockPlanner(names, plan, groups or [])
    for index, block in enumerate(blocks):
        block.forward = partial(planner.forward, index, block.forward)  # type: ignore[method-assign]
    return planner


def apply_activation_checkpointing(blocks: list[nn.Module], plan: CheckpointPlan) -> int:
    """Wrap the ``forward`` of the chosen blocks; returns how many may recompute."""
    wrap_blocks(blocks, plan)
    if plan.mode == "budget":
        return len(blocks)
    return sum(mode != "none" for mode in _fixed_modes(plan, len(blocks)))


def _lockstep_groups(mesh: DeviceMesh | None) -> list[dist.ProcessGroup]:
    # Data- and tensor-parallel peers run the same blocks at the same time; pipeline peers do not (an
    # all-reduce across stages inside a forward would deadlock the schedule).
    if mesh is None or mesh.mesh_dim_names is None:
        return []
    return [mesh.get_group(axis) for axis in mesh.mesh_dim_names if axis != "pp" and mesh[axis].size() > 1]


class ActivationCheckpointing(Callback):
    """Recompute activations in backward instead of keeping them.

    Args:
        mode: 'full' (every block), 'every_k' (every ``every``-th block), 'selective' (every block, keeping
            the outputs of the ops named by ``save`` and recomputing the rest), 'budget' (per block the
            least recompute among none / selective / full that keeps at most ``budget_mb``), or 'none'.
        every: the k of 'every_k'.
        save: for 'selective' and 'budget': 'attention' (keep attention outputs), 'attention_and_matmuls'
            (and every matmul output), or 'attention_and_up_projections' (and the outputs of matmuls that
            widen, such as an MLP's gate/up projections; recompute norms, RoPE, activations and the
            narrow projections).
        budget_mb: for 'budget': MiB of activations one forward of this rank's blocks may keep for
            backward (one microbatch under pipeline parallelism), measured at the first step.
        measure: measure each block's kept bytes at its first forward under its mode (always on for
            'budget'); ``report`` then lists them and they are logged as ``activation_mb/...``.

    With LLMParallelStrategy the strategy applies it at the right point of parallelization; with any other
    strategy the callback applies it itself in ``setup``.
    """

    def __init__(
        self,
        mode: Mode = "full",
        every: int = 2,
        save: Save = "attention",
        budget_mb: float | None = None,
        measure: bool = False,
    ) -> None:
        self.plan = CheckpointPlan(mode, every, save, budget_mb)
        self.measure = measure
        self.applied = False
        self.planner: BlockPlanner | None = None

    @property
    def report(self) -> list[dict[str, Any]] | None:
        """Per block: name, chosen mode, bytes kept, and bytes measured per mode (None until measured)."""
        return None if self.planner is None else self.planner.report

    def apply(self, module: nn.Module, mesh: DeviceMesh | None = None) -> None:
        if self.applied:
            return
        stack = find_block_stack(module)
        if stack is None:
            raise ValueError(
                "Activation checkpointing works per block; no stack of blocks (an nn.ModuleList, ModuleDict or"
                f" Sequential of them) was found in {type(module).__name__}. Name it with block_stack='...'."
            )
        if self.plan.mode != "none":
            _leave_recomputation_to_the_plan(module, self.plan.mode)
        self.planner = wrap_blocks(stack.modules(), self.plan, stack.names(), _lockstep_groups(mesh), self.measure)
        self.applied = True

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # LLMParallelStrategy applies it itself, between tensor parallelism and sharding.
        if not getattr(trainer.strategy, "applies_activation_checkpointing", False):
            self.apply(pl_module)
        if self.plan.mode != "none":
            _train_without_cache(pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        report = self.report
        if report is None:
            return
        metrics = {f"activation_mb/{r['block']}": r["bytes"] / 2**20 for r in report}
        metrics["activation_mb/total"] = sum(r["bytes"] for r in report) / 2**20
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)


def _leave_recomputation_to_the_plan(module: nn.Module, mode: Mode) -> None:
    """transformers' checkpointing (``activation_checkpointing_enable()``, before 5.x
    ``gradient_checkpointing_enable()``) wraps each layer's call in a checkpoint of its own, around the block this
    callback wraps. Every block it marks is
    then recomputed in full whatever the plan says ('selective', 'every_k', 'budget'), and with
    ``use_reentrant=True`` twice (three forwards per step). The plan is the more specific request, so transformers'
    flag is turned off: blocks recompute as the plan says and no more."""
    marked = [m for m in module.modules()
              if getattr(m, "gradient_checkpointing", None) is True and hasattr(m, "_gradient_checkpointing_func")]
    if not marked:
        return
    for m in marked:
        m.gradient_checkpointing = False
    rank_zero_warn(
        f"ActivationCheckpointing(mode={mode!r}) decides which blocks recompute; transformers' own checkpointing"
        " (activation_checkpointing_enable() or gradient_checkpointing_enable()) was on as well: it recomputes every"
        " block in full whatever the plan says, and twice under use_reentrant=True. It is turned off for this model."
        " To keep transformers' instead, drop the ActivationCheckpointing callback."
    )


def _train_without_cache(module: nn.Module) -> None:
    """transformers models keep a key/value cache in training forwards too (``use_cache=True``, their config's
    default). A recomputed block adds its keys to it again: selective recomputation then meets an op its forward
    did not run and fails, and the cache holds every layer's keys and values through backward. As transformers' own
    gradient checkpointing does, their training forwards run without one, unless the step asks for it."""

    def hook(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if not model.training or "use_cache" in kwargs or kwargs.get("past_key_values") is not None:
            return None
        return args, {**kwargs, "use_cache": False}

    hook_models_with_cache(module, hook, "_llmpar_no_cache_in_training")


def saved_activation_bytes(fn: Any, *args: Any) -> int:
    """Bytes ``fn(*args)`` leaves held for backward, including what checkpointed regions keep (see
    ``activation_memory.held_activation_bytes``)."""
    return held_activation_bytes(fn, *args)
