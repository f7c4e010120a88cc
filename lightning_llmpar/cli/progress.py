"""A progress bar for step-bounded runs: the bar counts the steps left, not a whole epoch, and no "Epoch 0/-2"."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

__all__ = ["StepRichProgressBar", "StepTQDMProgressBar", "step_progress_bar"]


def _steps_left(bar: Any, total: int | float) -> int | float:
    """The epoch's batches the run reaches: the bar counts batches of the epoch, so after a mid-epoch resume those
    already done count too (the bar read "30/9" for 10 steps left at batch 20)."""
    trainer = bar.trainer
    if trainer.max_steps is None or trainer.max_steps < 0:
        return total
    done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
    return min(total, done + max(left, 0))


class StepTQDMProgressBar(TQDMProgressBar):
    @property
    def total_train_batches(self) -> int | float:
        return _steps_left(self, super().total_train_batches)


class StepRichProgressBar(RichProgressBar):
    @property
    def total_train_batches(self) -> int | float:
        return _steps_left(self, super().total_train_batches)

    def _get_train_description(self, current_epoch: int) -> str:
        # Lightning writes "Epoch e/max_epochs-1", which reads "Epoch 0/-2" for runs bounded by max_steps.
        max_epochs = self.trainer.max_epochs
        if max_epochs is None or max_epochs < 0:
            return f"Epoch {current_epoch}"
        return super()._get_train_description(current_epoch)


def step_progress_bar() -> ProgressBar:
    """The bar Lightning would pick (rich when installed), counting steps for step-bounded runs."""
    return StepRichProgressBar() if _RICH_AVAILABLE else StepTQDMProgressBar()
