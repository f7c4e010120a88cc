"""Whole-model parameter counts under pipeline parallelism, for Lightning's model summary and the FLOPs count.

A pipeline rank's module holds only the rank's stages (tensor- and data-parallel shards are DTensors, whose sizes
are global, so they count right). Lightning's ``ModelSummary`` (on by default) printed the example GPT's 213,568
parameters at pp2 as 106,752: rank 0's stages. The summary callbacks of a pipelined run count over the pipeline
group instead, a weight tied across stages once (the head's copy of tied embeddings on the last stage was counted
again, 5% more FLOPs per token for a small tied Llama); the summary's rows stay the rank's own layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary
from torch import nn

from lightning_llmpar.training.clip import stages_of

__all__ = ["count_whole_model", "summarize_whole_model"]


def count_whole_model(module: nn.Module, strategy: Any, keep: Callable[[nn.Parameter], bool] = lambda p: True) -> int:
    """Elements of ``module``'s parameters that ``keep`` selects, over every pipeline stage (collective under
    pipeline parallelism: every rank calls it), a weight tied across stages counted once."""
    group, skip = stages_of(strategy)
    count = sum(p.numel() for p in module.parameters() if id(p) not in skip and keep(p))  # DTensor: global numel
    if group is None:
        return count
    total = torch.tensor([count], dtype=torch.int64, device=strategy.root_device)
    dist.all_reduce(total, group=group)
    return int(total.item())


class _WholeModel:
    """What ``ModelSummary.on_fit_start`` reads of a summary, with the whole model's counts."""

    def __init__(self, summary: Any, module: nn.Module, strategy: Any) -> None:
        self._summary = summary
        self.total_parameters = count_whole_model(module, strategy)
        self.trainable_parameters = count_whole_model(module, strategy, lambda p: p.requires_grad)
        self.model_size = self.total_parameters * summary._precision_megabytes
        self.total_training_modes = summary.total_training_modes
        self.total_flops = getattr(summary, "total_flops", 0)

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        return self._summary._get_summary_data()


def summarize_whole_model(trainer: Any) -> None:
    """Under pipeline parallelism, have the trainer's model summary callbacks count every stage's parameters."""
    if getattr(trainer.strategy, "pipeline_runner", None) is None:
        return
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummary) and "_summary" not in vars(callback):
            own = callback._summary

            def whole(trainer: Any, module: nn.Module, own: Callable[..., Any] = own) -> _WholeModel:
                # Lightning runs example_input_array through the module for the rows' sizes and the FLOPs; a rank's
                # stages cannot run it outside the pipeline (a user's example input failed the fit).
                example, module._example_input_array = module._example_input_array, None
                try:
                    return _WholeModel(own(trainer, module), module, trainer.strategy)
                finally:
                    module._example_input_array = example

            callback._summary = whole  # type: ignore[method-assign]
