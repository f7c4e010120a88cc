"""Whether Lightning will discard the gradients a training step starts with, unread.

Lightning runs ``training_step``, then ``zero_grad`` (on the first batch of an accumulation window), then
``backward``. A pipeline schedule runs backward inside ``training_step``, so the previous step's gradients are
still on the parameters while it runs; they only need keeping where something will read or keep them.
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["zero_grad_follows"]


def zero_grad_follows(trainer: Trainer) -> bool:
    """Whether Lightning zeroes the gradients right after every training step, unread: no accumulation over
    batches, backward not skipped, and no ``on_before_zero_grad`` or ``optimizer_zero_grad`` of the module's or a
    callback's own that could read them or keep some. Then the previous step's gradients can be released before
    the schedule instead of held beside this step's through it (a second copy of every gradient on the rank).
    Under accumulation they are kept on every batch: the later batches of a window need them, so releasing them
    on the first would not lower the peak."""
    if trainer.accumulate_grad_batches != 1 or trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward:
        return False
    module = trainer.lightning_module
    for name in ("on_before_zero_grad", "optimizer_zero_grad"):
        if getattr(type(module), name) is not getattr(LightningModule, name) or name in vars(module):
            return False
    return all(type(cb).on_before_zero_grad is Callback.on_before_zero_grad for cb in trainer.callbacks)
