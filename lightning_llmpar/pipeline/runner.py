"""Runs one Lightning step through the pipeline schedule and makes its effects look like a normal step.

Lightning expects ``training_step`` to return a loss and then calls ``zero_grad`` and ``backward``;
the schedule does forward and backward together. So gradients made by the schedule are set aside and
put back in ``backward`` (after Lightning's backward hooks fired), the loss and everything the step
logged are taken from the last stage and replayed on every rank, and nothing is logged twice. Gradients the
previous step left (where the strategy has not released them, see ``training.zero_grad``) are kept aside
through the schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torchmetrics import Metric

from lightning_llmpar.modeling.ties import TiedCopies
from lightning_llmpar.pipeline.logs import eval_tokens, merge_outputs, summarize_logs
from lightning_llmpar.pipeline.split import BATCH_KWARG, StageModule, stage_program
from lightning_llmpar.pipeline.stages import StageLayout, bubble_fraction, build_schedule
from lightning_llmpar.training.batches import batch_rows, batch_size, batch_tensors, share_item_count
from lightning_llmpar.training.logged_loss import LoggedCall, captured_logs, token_sum
from lightning_llmpar.training.loss_normalization import TokenNormalizer
from lightning_llmpar.training.quiet import frozen_metrics, synced_only

__all__ = ["PipelineRunner"]


class PipelineRunner:
    def __init__(
        self,
        module: LightningModule,
        blocks: nn.ModuleList | nn.ModuleDict,
        layout: StageLayout,
        parts: dict[int, dict[str, nn.Module]],
        swaps: dict[str, tuple[nn.Module, nn.Module]],
        pp_mesh: DeviceMesh,
        device: torch.device,
        schedule: str,
        microbatches: int,
        ties: TiedCopies | None = None,
        tokens: TokenNormalizer | None = None,
    ) -> None:
        self.module, self.blocks, self.layout, self._swaps = module, blocks, layout, swaps
        self.ties, self.tokens = ties, tokens
        self.pp_group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        self.device, self.schedule_name, self.microbatches = device, schedule, microbatches
        self.stage_modules = {s: StageModule(self, s, parts[s]) for s in sorted(parts)}
        self._accepts: dict[tuple[int, bool], bool] = {}  # (microbatches, training): does the schedule take it
        self._schedule_in_use: tuple[tuple[int, bool, tuple], Any] | None = None
        self._stages: list[PipelineStage] | None = None
        self._method, self._step_args = "training_step", ()
        self._logged: list[LoggedCall] = []
        self._outputs: list[Any] = []
        # Per microbatch on the last stage: the loss the user's step returned, its valid targets (token normalization).
        self._raw_losses: list[Tensor] = []
        self._tokens_of: list[int] = []
        self._batch: Any = None  # the step's batch (of _size samples), which the stages take microbatches' rows from
        self._size = 0
        self.step_loss: Tensor | None = None  # the step's loss and its valid targets, on every pp rank
        self.step_tokens = 1.0
        self._stash: dict[nn.Parameter, Tensor | None] = {}
        self._accumulate = 1
        self.inferring = 0  # > 0 while a stage learns shapes on placeholders (see _mark_metadata_inference)
        self._last_stage_running = False
        self.defer_reduction = False  # in a micro-step that is not the optimizer step's last (see deferring_reduction)
        # Loss scaling (FP16): the schedule runs backward itself, so the scale is applied per microbatch.
        self.scale_loss: Callable[[Tensor], Tensor] | None = None
        self.timeline: list[tuple[int, str, int, float, float]] = []  # (stage, kind, microbatch, t0, t1)
        self.step_window: tuple[float, float] = (0.0, 0.0)
        # Context parallelism: each stage cuts every microbatch along the sequence (see context_parallel.apply).
        self.context_parallel: Any = None

    # ------------------------------------------------------------------ stages and schedules

    @property
    def last_rank(self) -> int:
        return self.layout.rank_of(self.layout.num_stages - 1)

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.last_rank

    @property
    def counting(self) -> bool:
        """True while the step runs as one process's would, a microbatch at a time: on the last stage, and not on
        the placeholders a stage learns shapes from. State a step keeps itself should count only then."""
        return self._last_stage_running and not self.inferring

    def _build_stages(self) -> list[PipelineStage]:
        if self._stages is None:
            self._stages = [
                PipelineStage(m, s, self.layout.num_stages, self.device, group=self.pp_group)
                for s, m in self.stage_modules.items()
            ]
            for stage in self._stages:
                self._record_actions(stage)
                self._mark_metadata_inference(stage)
                self._defer_reduce_grad(stage)
        return self._stages

    def _defer_reduce_grad(self, stage: PipelineStage) -> None:
        # torch's schedules end every step with the stage's gradient reduction (FSDP post-backward), even inside
        # Lightning's no-sync accumulation micro-steps. Held back there, gradients accumulate unreduced in FSDP
        # and are reduced once, in the optimizer step's last micro-step (grads are never scaled: scale_grads=False).
        original = stage.perform_reduce_grad

        def reduce_grad(grad_scale_factor: int) -> None:
            if not (self.defer_reduction and grad_scale_factor == 1):
                original(grad_scale_factor)
            elif isinstance(stage.submod, FSDPModule):
                # Single-stage schedules leave the stage unsharded after its backward, so the module would show its
                # unsharded parameters, whose gradients (this rank's, unreduced) the step takes as its result. Back
                # to shards: the unsharded gradients stay inside FSDP for the reduction that sums the micro-steps.
                # Every unit of the stage, the experts' own too (expert parallelism): a unit left unsharded lost
                # this micro-step's gradients (measured: experts 2e-3 off one process at ep2 x pp2 1F1B).
                for unit in stage.submod.modules():
                    if isinstance(unit, FSDPModule):
                        unit.reshard()

        stage.perform_reduce_grad = reduce_grad  # type: ignore[method-assign]

    @contextmanager
    def deferring_reduction(self) -> Iterator[None]:
        """Lightning's accumulation micro-steps before the last: no gradient reduction at the schedule's end."""
        self.defer_reduction = True
        try:
            yield
        finally:
            self.defer_reduction = False

    def _mark_metadata_inference(self, stage: PipelineStage) -> None:
        # On first use the stage runs its forward (and the loss) once more on placeholder tensors to
        # learn shapes. That run must not log, update metrics or count as a microbatch.
        for attr in ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference"):
            original = getattr(stage, attr, None)
            if original is None:
                continue

            def flagged(*args: Any, __orig: Callable = original, **kwargs: Any) -> Any:
                self.inferring += 1
                try:
                    return __orig(*args, **kwargs)
                finally:
                    self.inferring -= 1

            setattr(stage, attr, flagged)
        to_tensor = getattr(stage, "_to_tensor", None)
        if to_tensor is not None:
            # The placeholders made from shapes are uninitialized memory (NaN, inf): a forward that checks its
            # activations would fail on one stage only, and the others would wait for it forever. Zeros pass.
            def zeroed(arg: Any, __orig: Callable = to_tensor) -> Any:
                out = __orig(arg)
                if not isinstance(arg, Tensor):
                    with torch.no_grad():
                        out.zero_()
                return out

            stage._to_tensor = zeroed

    def _build_schedule(self, microbatches: int, training: bool) -> Any:
        return build_schedule(self.schedule_name, self._build_stages(), microbatches, self._loss, self.layout, training)

    def _schedule(self, microbatches: int, training: bool, batch: Any) -> Any:
        """The schedule for this step, built afresh whenever the one in use or the batch's shapes change: a torch
        schedule sets the shared stages up on first use (receive buffers of the microbatches' shapes, with gradients
        or not), so a kept one would run on another's buffers. torch's ``eval`` does the same."""
        shapes = tuple(tuple(t.shape) for t in batch_tensors(batch))
        key = (microbatches, training, shapes)
        if self._schedule_in_use is None or self._schedule_in_use[0] != key:
            self._schedule_in_use = (key, self._build_schedule(microbatches, training))
        return self._schedule_in_use[1]

    def _takes(self, microbatches: int, training: bool) -> bool:
        key = (microbatches, training)
        if key not in self._accepts:
            try:  # a schedule touches its stages only when it runs
                self._accepts[key] = self._build_schedule(microbatches, training) is not None
            except ValueError:  # e.g. 1F1B needs at least as many microbatches as stages
                self._accepts[key] = False
        return self._accepts[key]

    def microbatches_for(self, size: int, training: bool) -> int:
        """The configured microbatch count, or for a batch it does not divide (an epoch's last batch, evaluation)
        the largest count below it that divides the batch and the schedule accepts (the result is the same)."""
        for n in range(min(self.microbatches, size), 0, -1):
            if size % n == 0 and self._takes(n, training):
                return n
        raise ValueError(
            f"A batch of {size} samples cannot be split into microbatches for pipeline_schedule={self.schedule_name!r}"
            f" on {self.layout.pp} ranks ({self.layout.num_stages} stages). Use batch sizes that are multiples of"
            f" pipeline_microbatches={self.microbatches} (drop_last=True for the training loader), or a schedule that"
            " takes fewer microbatches (GPipe, LoopedBFS)."
        )

    def _loss(self, output: Tensor, target: Any) -> Tensor:
        # The stage output of the last stage is the user's loss for one microbatch (already weighed by its
        # tokens under loss_normalization='tokens', whose step then divides by their total).
        loss = output / ((1 if self.tokens is not None else self._n_mb) * self._accumulate)
        return self.scale_loss(loss) if self.scale_loss is not None else loss

    def _record_actions(self, stage: PipelineStage) -> None:
        # Wrap the stage's compute entry points to time every action the schedule really runs.
        for attr, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
            original = getattr(stage, attr, None)
            if original is None:
                continue

            def timed(*args: Any, __orig: Callable = original, __kind: str = kind, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                out = __orig(*args, **kwargs)
                mb = args[0] if args and isinstance(args[0], int) else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
                self.timeline.append((stage.stage_index, __kind, int(mb), t0, time.perf_counter()))
                return out

            setattr(stage, attr, timed)

    # ------------------------------------------------------------------ the stage program

    def run_stage(self, stage: int, microbatch: Tensor, incoming: Tensor | None) -> Tensor:
        last = stage == self.layout.num_stages - 1
        # The schedule splits a tensor of microbatch numbers; the rows come from the step's batch, in its structure
        # (torch's own split copies per-sample lists and dataclasses whole into every microbatch).
        # Shape inference may run on placeholders (meta, zeros): any microbatch gives the shapes.
        n = min(max(int(microbatch[0]), 0), self._n_mb - 1) if microbatch.device.type != "meta" else 0
        rows = self._size // self._n_mb
        batch = share_item_count(batch_rows(self._batch, n * rows, (n + 1) * rows, self._size), self._n_mb, self.tokens)
        # Modules before the stack run as stand-ins on every stage but the first (they only give shapes; the
        # stage's input replaces their output). Those after it are stand-ins already on ranks without the last.
        stand_ins = {name: stand_in for name, (_, stand_in) in self._swaps.items()} if stage != 0 else {}

        full, cp = batch, self.context_parallel if self._method == "training_step" else None
        if cp is not None:  # every stage runs the step on the microbatch, so every stage cuts it the same way
            batch = cp.begin_step(batch)

        def call() -> Any:
            self._last_stage_running = last
            try:
                with frozen_metrics(self.module) if self.inferring else nullcontext():
                    return getattr(self.module, self._method)(batch, *self._step_args)
            finally:
                self._last_stage_running = False

        cut, out = stage_program(self.module, self.blocks, self.layout.block_ranges[stage], last, incoming, stand_ins, call)
        if cut:
            return out
        loss = raw = out.get("loss") if isinstance(out, dict) else out
        if cp is not None:
            # This microbatch's share of the cp group's targets; the step's result is the weighted loss (its mean
            # over the cp ranks is one process's).
            loss = loss * cp.weight()
            out = {**out, "loss": loss} if isinstance(out, dict) else loss
        if not self.inferring:
            self._outputs.append(out)
            if self._method == "training_step":
                self._raw_losses.append(raw)
            elif self.tokens is not None and self._method != "predict_step":  # weighs what evaluation logs
                self._tokens_of.append(eval_tokens(self.tokens, full))
        if self._method == "training_step":
            if self.tokens is not None:
                n = self.tokens.count(full) if self.inferring else self.tokens.add(full)
                if not self.inferring:
                    self._tokens_of.append(n)
                return loss * n
            return loss
        # Eval steps return nothing the schedule needs, but it concatenates last-stage outputs.
        return torch.zeros(1, device=self.device)

    # ------------------------------------------------------------------ one Lightning step

    def run(self, method: str, batch: Any, step_args: tuple, accumulate: int = 1) -> Any:
        """Run ``method`` (e.g. 'training_step') on ``batch`` through the schedule; return its result."""
        size = batch_size(batch)
        training = method == "training_step"
        n_mb = self.microbatches_for(size, training)
        self._method, self._step_args, self._n_mb, self._accumulate = method, step_args, n_mb, accumulate
        self._outputs, self._raw_losses, self._tokens_of, self._batch, self._size = [], [], [], batch, size
        schedule = self._schedule(n_mb, training, batch)
        numbers = torch.arange(n_mb, device=self.device)  # what the schedule splits: one number per microbatch
        placeholder = torch.zeros(size, device=self.device)  # the loss lives in the stage output, not a target
        start = time.perf_counter()
        self.timeline = []
        with captured_logs(self.module, keep=lambda: not self.inferring) as self._logged:
            if training:
                self._stash_grads()
                with self._context_parallel_step():
                    schedule.step(target=placeholder, return_outputs=False, **{BATCH_KWARG: numbers})
                if self.ties is not None:
                    self.ties.sum_grads()  # copies of a tied weight on several stages: one gradient
                self._take_new_grads()
            else:
                schedule.eval(target=placeholder, **{BATCH_KWARG: numbers})
        self.step_window = (start, time.perf_counter())
        result = self._result(method)
        self._replay_logs()
        return result

    @contextmanager
    def _context_parallel_step(self) -> Iterator[None]:
        cp = self.context_parallel
        if cp is None:
            yield
            return
        cp.active = True  # through the schedule's backward too: recomputation runs attention again
        try:
            yield
            cp.end_forward("training_step")
        finally:
            cp.active, cp.loss_weight = False, 1.0  # the weights are in the microbatch losses already

    def _result(self, method: str) -> Any:
        """What the step returned, as one process would see it, on every rank: the microbatch outputs of the
        last stage merged (the loss averaged; a training dict keeps its other entries)."""
        outs = self._outputs[-self._n_mb :] if self.is_last else []
        if method == "training_step":
            losses = [o.get("loss") if isinstance(o, dict) else o for o in outs]
            wide = float(bool(losses) and losses[0].dtype == torch.float64)  # '64-true': logged in float64 too
            stacked = torch.stack([loss.detach().double().cpu() for loss in losses]) if losses else torch.zeros(1)
            counts = torch.tensor(self._tokens_of[-len(losses) :] if losses and self.tokens else [1.0], dtype=torch.float64)
            tokens, value = counts.sum(), stacked.mean()
            if losses and self.tokens is not None and float(tokens) > 0:  # the mean over the step's valid targets
                value = token_sum(stacked, counts) / tokens
            has_extras = float(bool(outs) and isinstance(outs[0], dict) and len(outs[0]) > 1)
            packed = torch.tensor([float(value), has_extras, float(tokens), wide], dtype=torch.float64).to(self.device)
            dist.broadcast(packed, group=self.pp_group, group_src=self.last_rank)  # one broadcast
            value = self.step_loss = packed[0].to(torch.float64 if packed[3] else torch.float32)
            self.step_tokens = float(packed[2])
            if not packed[1]:
                return value
            box = [merge_outputs([{k: v for k, v in o.items() if k != "loss"} for o in outs]) if self.is_last else None]
            dist.broadcast_object_list(box, group=self.pp_group, group_src=self.last_rank)
            return {"loss": value, **box[0]}
        box = [merge_outputs(outs) if self.is_last else None]
        dist.broadcast_object_list(box, group=self.pp_group, group_src=self.last_rank)
        return box[0]

    # ------------------------------------------------------------------ logging

    def _replay_logs(self) -> None:
        # Only the last stage ran the step to the end; average what it logged over microbatches and log the same on
        # every rank, so loggers on rank 0 and sync_dist collectives see it everywhere. Each microbatch's own loss is
        # logged as the step's (the tensor it returns), which the strategy logs as the global batch's (logged_loss).
        summary: list[Any] = []
        if self.is_last:
            metric_names = {id(m): n for n, m in self.module.named_modules() if isinstance(m, Metric)}
            summary = summarize_logs(self._logged[-self._n_mb * 64 :], self._n_mb, self._raw_losses[-self._n_mb :],
                                     self._tokens_of[-self._n_mb :] if self.tokens is not None else [], metric_names)
        box = [summary]
        dist.broadcast_object_list(box, group=self.pp_group, group_src=self.last_rank)
        for name, (kind, payload), args, kwargs in box[0]:
            if kind == "metric":
                value = self.module.get_submodule(payload)
                if not self.is_last:
                    synced_only(value)
            elif kind == "loss" and self.step_loss is not None:
                value = self.step_loss
            else:
                value = torch.tensor(payload, device=self.device)
            self.module.log(name, value, *args, **kwargs)

    # ------------------------------------------------------------------ gradients

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _stash_grads(self) -> None:
        self._previous = {p: p.grad for p in self._params()}
        for p in self._previous:
            p.grad = None

    def _take_new_grads(self) -> None:
        self._stash = {p: p.grad for p in self._previous}
        for p, g in self._previous.items():
            p.grad = g
        self._previous = {}

    def restore_grads(self) -> None:
        """Called from the strategy's backward: add this step's gradients to whatever survived zero_grad."""
        for p, g in self._stash.items():
            if g is None:
                continue
            p.grad = g if p.grad is None else p.grad + g
        self._stash = {}

    def bubble_fraction(self) -> float:
        """Idle share of this rank during the last step."""
        return bubble_fraction(self.timeline, self.step_window)
