"""Where Lightning's optimizer steps fall under gradient accumulation."""

from __future__ import annotations

from typing import Any

__all__ = ["ends_a_step"]


def ends_a_step(trainer: Any) -> bool:
    """Whether the training batch now running ends with an optimizer step (from its start to its end hooks).

    Not ``(batch_idx + 1) % accumulate_grad_batches == 0``: Lightning also steps on an epoch's last batch when the
    group is not full (5 batches in groups of 2 step after batches 2, 4 and 5), and ``batch_idx`` restarts each epoch.
    """
    return not trainer.fit_loop.epoch_loop._should_accumulate()
