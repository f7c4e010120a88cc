"""Token-exact losses: the mean over every valid target token of the optimizer step, as one process computes it.

By default (``loss_normalization="mean"``, what DDP and FSDP do) each microbatch's and each data-parallel
rank's mean loss weighs the same, which differs from one process's mean over valid tokens when padding or
``ignore_index`` leaves microbatches with different numbers of them. With ``"tokens"`` each loss is weighted
by its number of valid targets before backward, and the step's gradients are divided by the total over all
microbatches, accumulation steps and data-parallel ranks (one all-reduce) before clipping and the update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_llmpar.modeling.structure import is_transformers
from lightning_llmpar.training.ignore_index import IGNORE_INDEX, IgnoreIndex

__all__ = ["PaddedMeanWarning", "TokenNormalizer", "batch_targets", "count_target_tokens", "label_counter",
           "model_shifts_labels", "refuse_several_manual_optimizers"]


def batch_targets(batch: Any, shifted: bool = True) -> Tensor | None:
    """A dict's ``labels`` (shifted by one as transformers' causal-LM loss does, where ``shifted``; a sample's
    class labels, 1-D, never are), a dict's ``targets`` (already shifted: the bundled packed rows), or the targets
    (second element) of an ``(inputs, targets)`` pair."""
    if isinstance(batch, dict) and isinstance(batch.get("labels"), Tensor):
        labels = batch["labels"]
        return labels[..., 1:] if shifted and labels.dim() > 1 else labels
    if isinstance(batch, dict) and isinstance(batch.get("targets"), Tensor):
        return batch["targets"]
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[1], Tensor):
        return batch[1]
    return None


def count_target_tokens(batch: Any, shifted: bool = True, ignore_index: int = IGNORE_INDEX) -> int:
    """Valid targets of a batch (see ``batch_targets``): those not equal to ``ignore_index``."""
    targets = batch_targets(batch, shifted)
    if targets is not None:
        return int((targets != ignore_index).sum())
    raise ValueError(
        f"loss_normalization='tokens' counts valid targets in a dict's 'labels' or 'targets' or the second element of a"
        f" tuple; this"
        f" {type(batch).__name__} batch has neither. Pass loss_normalization=<callable(batch) -> number of tokens>."
    )


def model_shifts_labels(module: nn.Module) -> bool:
    """Whether a dict's ``labels`` are the inputs themselves, which the model shifts by one for its loss: true of
    transformers' causal LMs (and of a model of one's own, by this convention); not of encoder-decoders (T5, BART:
    the labels are the decoder's targets), masked LMs or classifiers, whose every label is a target."""
    model = next((m for m in module.modules() if is_transformers(m, "PreTrainedModel")), None)
    if model is None:
        return True
    if getattr(model.config, "is_encoder_decoder", False):
        return False
    return type(model).__name__.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))


def label_counter(module: nn.Module, ignore: IgnoreIndex) -> Callable[[Any], int]:
    """``count_target_tokens`` as ``module``'s loss counts its labels (see ``model_shifts_labels``), skipping the
    targets its loss ignores (``ignore``, read from the loss calls)."""
    shifted = model_shifts_labels(module)

    def count(batch: Any) -> int:
        return count_target_tokens(batch, shifted, ignore.noted())

    return count


class TokenNormalizer:
    """Counts the valid tokens behind each loss of a step and rescales the step's gradients by their total.

    ``index`` gives the ignore index the default counter skips: a training step may tell it only after its batch
    was counted (its loss calls, training.ignore_index), so the step's count is settled when first used."""

    def __init__(self, count: Callable[[Any], int], tp: int, dp: int, device: torch.device,
                 index: Callable[[], int] | None = None) -> None:
        self.count, self.tp, self.dp, self.device = count, tp, dp, device
        self.index = index or (lambda: IGNORE_INDEX)
        self.tokens = 0  # on this rank, since the last optimizer step, for losses this rank computed
        self.step_tokens = 1  # behind the loss of the micro-step in flight (its backward weighs the mean by it)
        self._stepped = False  # this step's gradients are rescaled already (begin_step starts a step)
        self._counted = 0  # batches counted since the last rescale
        self._batch: Any = None
        self._counted_with = IGNORE_INDEX

    def add(self, batch: Any) -> int:
        self._batch, self._counted_with = batch, self.index()
        n = int(self.count(batch))
        self.tokens += n
        self.step_tokens, self._counted = n, self._counted + 1
        return n

    def begin_step(self) -> None:
        """A training step starts: its gradients (with those of the steps it accumulates on) await rescaling."""
        self._stepped = False

    def settled(self) -> int:
        """The last count, counted again if the loss has told another ignore index since (before its use)."""
        if self._batch is not None and not self._stepped and self.index() != self._counted_with:
            self.tokens, self._counted = self.tokens - self.step_tokens, self._counted - 1
            self.add(self._batch)
        return self.step_tokens

    @torch.no_grad()
    def finish(self, params: Iterable[Tensor], accumulate: int, manual: bool = False) -> None:
        """Turn the accumulated sum of token-weighted gradients into the per-token mean of the step.

        Gradients hold (1/dp)(1/accumulate) x sum over losses of (tokens x gradient of the mean loss):
        data-parallel averaging and Lightning's accumulation divide; multiplying by dp x accumulate / N leaves
        the sum over all tokens divided by N. Every tensor-parallel rank counted the same tokens, so the world
        sum is divided by tp.
        """
        if self._stepped:  # once per step: where a step optimized by hand clips, and again at its optimizer step
            return
        if manual and self._counted > 1:
            raise ValueError(
                "loss_normalization='tokens' with manual optimization divides each optimizer step's gradients by the"
                f" valid targets of its training step, but this optimizer step follows {self._counted} training steps"
                " (gradients accumulated by hand, or a training step without backward), whose losses one process"
                " would weigh as the step's code does. Step the optimizer in every training step, or use"
                " loss_normalization='mean' (or accumulate_grad_batches with automatic optimization)."
            )
        self.settled()
        total = torch.tensor([float(self.tokens)], dtype=torch.float64, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        tokens = float(total) / self.tp
        self.tokens, self._stepped, self._batch, self._counted = 0, True, None, 0
        if tokens <= 0:
            return
        factor = self.dp * accumulate / tokens
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)


def refuse_several_manual_optimizers(optimizers: list[Any]) -> None:
    """Under loss_normalization='tokens' a step optimized by hand has one count, rescaled once: with several
    optimizers each stepping its own backward, the later ones' gradients would not be rescaled."""
    if len(optimizers) > 1:
        raise ValueError(
            f"loss_normalization='tokens' with manual optimization rescales the gradients of a training step once, by"
            f" its valid targets; this module optimizes by hand with {len(optimizers)} optimizers, whose separate"
            " backward passes and steps it cannot rescale each. Use loss_normalization='mean' (the step's own"
            " losses, as one process computes them) or one optimizer."
        )


class PaddedMeanWarning:
    """Under the default ``loss_normalization='mean'``, where the layout cuts each batch into parts whose mean losses
    weigh the same (data-parallel ranks, pipeline microbatches): warns once if one of the first training batches
    has ignored targets, since then the parts' valid targets differ and the loss and gradients are not one
    process's mean over the batch; once more for the first evaluation batches (a validation loss). Only the first
    batches are looked at: each look reads the targets' values."""

    def __init__(self, parts: str, looks: int = 8) -> None:
        self.parts, self.looks = parts, {"training": looks, "evaluation": looks}

    def see(self, batch: Any, kind: str = "training", ignore_index: int = IGNORE_INDEX) -> None:
        if self.looks[kind] <= 0:
            return
        self.looks[kind] -= 1
        targets = batch_targets(batch)
        if targets is None or not bool((targets == ignore_index).any()):
            return
        self.looks[kind] = 0
        differ = ("the loss and gradients differ" if kind == "training" else
                  "a logged mean such as a validation loss differs (NaN where a part has no valid target)")
        rank_zero_warn(
            f"LLMParallelStrategy: a{'n' if kind == 'evaluation' else ''} {kind} batch has ignored targets"
            f" ({ignore_index}, the loss's ignore_index: padding or masked prompts) and this layout cuts every batch into {self.parts}, whose"
            f" mean losses weigh the same under loss_normalization='mean' (the default, as DDP does): {differ} from"
            " one process's mean over the batch's valid targets. Pass loss_normalization='tokens' for that mean"
            " (docs/layouts.md, Padding and loss normalization)."
        )
