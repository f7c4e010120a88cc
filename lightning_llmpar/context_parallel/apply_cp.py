"""Context parallelism for any LightningModule: cut each training batch along the sequence, give the model the
positions and shifted targets it can no longer derive, and route its causal SDPA calls to ring or Ulysses
attention over the ``cp`` mesh axis. Parameters need nothing: FSDP shards them over dp_shard x cp.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_llmpar.context_parallel.attention import context_parallel_attention, enable_device_ring
from lightning_llmpar.context_parallel.hf_attention import prepare_hf_attention
from lightning_llmpar.context_parallel.sequence import IGNORE_INDEX, SHIFT_IN_STEP, SequenceShard, shard_batch

__all__ = ["ContextParallel", "apply_context_parallel", "check_sequence_mixers"]


def _takes(module: nn.Module, name: str) -> int | None:
    """Position of ``name`` among ``module.forward``'s arguments (None if it has no such argument)."""
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    return params.index(name) if name in params else None


def check_sequence_mixers(module: nn.Module) -> None:
    """Refuse a model that mixes tokens along the sequence outside attention: a convolution over it (Mamba's,
    LFM2's short convolution) or a recurrent scan (a module holding its state's decay: ``A_log`` in Mamba and the
    gated delta rule, ``slope_rate`` and the ``*_decay`` tables in MiniMax's lightning attention, RWKV's
    ``time_decay``). Ring and Ulysses attention carry neither across ranks, so each rank's part would start from
    nothing. (A model mixing them with SDPA layers still calls SDPA, so the first step's check cannot tell.)"""
    for name, sub in module.named_modules():
        held = {*sub._parameters, *sub._buffers}
        if isinstance(sub, nn.Conv1d) or held & {"A_log", "slope_rate"} or any("decay" in n for n in held):
            raise ValueError(
                f"context_parallel gives each rank part of every sequence, but '{name}' ({type(sub).__name__}) mixes"
                " tokens along the sequence outside attention (a convolution or a recurrent scan, as Mamba and"
                " linear-attention layers do), and would not see the tokens before its rank's part: wrong results."
                " Use context_parallel=1 for this model; tensor, pipeline and data parallelism take it."
            )


class ContextParallel:
    """This rank's context-parallel state: the cp mesh, the attention mode and the current step's shard."""

    def __init__(self, mesh: DeviceMesh, mode: str) -> None:
        self.mesh, self.mode = mesh, mode
        self.cp, self.rank = mesh.size(), mesh.get_local_rank()
        self.active = False  # from a training step's start through its backward (recomputation calls attention)
        self.shard: SequenceShard | None = None
        self.loss_weight = 1.0
        self.no_local_targets = False
        self.ignore_index: Callable[[], int] = lambda: IGNORE_INDEX  # the loss's (see training.ignore_index)
        self._counted_with = IGNORE_INDEX
        self.attention_calls = 0
        self.checked = False
        self._sdpa = F.scaled_dot_product_attention
        self._position_index: int | None = None
        self._hf_labels = False
        self._root_takes_positions = self._step_call = False
        self.bytes_sent = 0  # attention traffic this rank sent in the forward passes since the last optimizer step

    # ------------------------------------------------------------------ set-up

    def prepare(self, module: nn.Module) -> None:
        """Find where positions enter, switch transformers models to mask-free causal attention, patch SDPA."""
        check_sequence_mixers(module)
        takers = [m for m in module.modules() if _takes(m, "position_ids") is not None]
        # Lightning passes every step through the root module's __call__ (its forward redirection), so a hook on the
        # root also sees the step's own arguments: a model inside it that takes positions is where they enter.
        target = next((m for m in takers if m is not module), takers[0] if takers else None)
        if target is None:
            raise ValueError(
                f"context_parallel gives each rank part of every sequence, so the model must be told its tokens'"
                f" positions, but no submodule of {type(module).__name__} takes `position_ids` in forward. Add a"
                " `position_ids` argument to the model's forward (positions of the tokens it is given, as a"
                " transformers model takes), or use context_parallel=1."
            )
        self._position_index = _takes(target, "position_ids")
        self._root_takes_positions = target is module
        self._hf_labels = prepare_hf_attention(module, lambda: self.active) and _takes(target, "labels") is not None
        target.register_forward_pre_hook(self._inject, with_kwargs=True)

    def install(self) -> None:
        """Route ``F.scaled_dot_product_attention`` through this object for the run (undone by ``teardown``)."""
        if self.mesh.device_type != "cpu":
            enable_device_ring()
        if F.scaled_dot_product_attention != self._attention:
            self._sdpa = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = self._attention  # type: ignore[assignment]

    def teardown(self) -> None:
        self.active = False
        if F.scaled_dot_product_attention == self._attention:
            F.scaled_dot_product_attention = self._sdpa  # type: ignore[assignment]

    # ------------------------------------------------------------------ per step

    def run(self, training: bool, call: Callable[..., Any], method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``call(method, *args, **kwargs)``: a training step on this rank's part of each sequence; evaluation
        steps on whole sequences."""
        self.active = training
        # The first call of the root is the step itself, redirected (see prepare): not a forward to give positions.
        self._step_call = self._root_takes_positions
        try:
            if not training:
                return call(method, *args, **kwargs)
            output = call(method, self.begin_step(args[0]), *args[1:], **kwargs)
        finally:
            self._step_call = False
        self.end_forward(method)
        return output

    def begin_step(self, batch: Any) -> Any:
        """Cut ``batch`` for this rank and weigh its loss by its share of the step's valid targets."""
        self.active, self.attention_calls = True, 0
        batch, self.shard = shard_batch(batch, self.cp, self.rank, self.mode)
        self.loss_weight, self.no_local_targets = 1.0, False
        if self.shard is not None and self.shard.targets is not None:
            self._weigh()
        return batch

    def weight(self) -> float:
        """This rank's loss weight; counted again where the step's loss told another ignore index (the first
        steps, training.ignore_index) after ``begin_step`` counted (every cp rank runs the same loss calls)."""
        if self.shard is not None and self.shard.targets is not None and self.ignore_index() != self._counted_with:
            self._weigh()
        return self.loss_weight

    def _weigh(self) -> None:
        # Each cp rank's loss is a mean over its own valid targets; weighing it by cp x (its count / all
        # ranks' count) makes the average that FSDP takes over cp the mean over every target of the sequences.
        assert self.shard is not None and self.shard.targets is not None
        self._counted_with = self.ignore_index()
        valid = self.shard.targets != self._counted_with
        if self.shard.appended is not None:  # the target after the last token, ignored whatever the index
            valid[:, self.shard.appended] = False
        counts = torch.tensor([float(valid.sum())], dtype=torch.float64,
                              device=self.shard.targets.device)
        local = float(counts)
        self.no_local_targets = local == 0
        dist.all_reduce(counts, group=self.mesh.get_group())
        self.loss_weight = self.cp * local / float(counts) if float(counts) > 0 else 0.0

    def end_forward(self, step: str) -> None:
        """After the first training step's forward: the model really ran through context-parallel attention."""
        if self.checked or self.shard is None:
            return
        self.checked = True
        if self.attention_calls == 0:
            raise ValueError(
                f"context_parallel={self.cp} cut the sequence, but the model never called"
                f" torch.nn.functional.scaled_dot_product_attention during {step}, so its attention (a custom"
                " kernel, or a function imported before set-up) cannot see the other ranks' tokens. Use SDPA attention"
                " (transformers: attn_implementation='sdpa'), or context_parallel=1."
            )
        if self.shard.shifted and not self.shard.labels_seen:
            raise ValueError(
                "context_parallel cuts every sequence, so targets must be shifted by one before the cut; this dict"
                " batch's 'labels' never reached a transformers model's forward, which is where they would be. Pass"
                " labels=batch['labels'] to the transformers model, or put already shifted targets in the batch (with"
                " -100 where ignored) and compute the loss without shifting."
            )

    def _inject(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if self._step_call:
            self._step_call = False
            return None
        if not self.active or self.shard is None:
            return None
        self._check_length(args, kwargs)
        index = self._position_index
        positional = index is not None and index < len(args)
        given = args[index] if positional else kwargs.get("position_ids")
        if given is None:
            positions = self.shard.positions
        elif given.shape[-1] == self.shard.seq_len:  # positions of the whole sequence: cut them like the tokens
            positions = given.index_select(-1, self.shard.positions[0])
        else:
            positions = given
        if positional:
            args = (*args[:index], positions, *args[index + 1 :])
        else:
            kwargs["position_ids"] = positions
        labels = kwargs.get("labels")
        if self._hf_labels and isinstance(labels, Tensor):
            shifted = self.shard.shifted.get(id(labels))
            if shifted is not None:
                ignore = kwargs.get("ignore_index", IGNORE_INDEX)
                if isinstance(ignore, int) and ignore != IGNORE_INDEX and self.shard.appended is not None:
                    # transformers pads the shifted labels with the loss's ignore_index, not -100.
                    shifted[:, self.shard.appended] = ignore
                kwargs["shift_labels"] = shifted
                self.shard.labels_seen = True
                if self.no_local_targets and kwargs.get("num_items_in_batch") is None:
                    # Every target of this rank's part is ignored: a mean over none is 0/0 and its gradient NaN. A sum
                    # over none divided by 1 is 0 with zero gradients, and this rank's loss weight is 0 anyway.
                    kwargs["num_items_in_batch"] = 1
        return args, kwargs

    def _check_length(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """The model must get this rank's part of the sequence as cut, not a slice of it (before it runs)."""
        assert self.shard is not None
        first = args[0] if args else next((kwargs[k] for k in ("input_ids", "inputs_embeds", "idx") if k in kwargs), None)
        local = self.shard.positions.shape[-1]
        if isinstance(first, Tensor) and first.ndim >= 2 and first.shape[1] != local:
            raise ValueError(
                f"context_parallel={self.cp} cut every sequence of the batch (length {self.shard.seq_len}) before the"
                f" training step, giving this rank {local} tokens of each, but the model was given {first.shape[1]}:"
                f" the step slices the sequence itself. {SHIFT_IN_STEP}"
            )

    @torch.compiler.disable  # compiled blocks run attention eagerly: the ring's process-group calls do not trace
    def _attention(self, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not self.active:
            return self._sdpa(query, key, value, *args, **kwargs)
        self.attention_calls += 1
        # What moves per call: ring sends k and v around cp - 1 hops; Ulysses sends q, k, v and the output once.
        if self.mode == "ring":
            self.bytes_sent += 2 * key.numel() * key.element_size() * (self.cp - 1)
        else:
            self.bytes_sent += 4 * query.numel() * query.element_size() * (self.cp - 1) // self.cp
        documents = self.shard.documents if self.shard is not None else None
        return context_parallel_attention(self.mode, self.mesh, self._sdpa, query, key, value, *args, **kwargs,
                                          documents=documents)


def apply_context_parallel(module: nn.Module, mesh: DeviceMesh, mode: str) -> ContextParallel:
    """Prepare ``module`` for context parallelism over ``mesh`` (the cp axis); ``install`` before training."""
    cp = ContextParallel(mesh, mode)
    cp.prepare(module)
    return cp
