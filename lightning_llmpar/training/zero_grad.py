"""Releasing the gradients Lightning would discard unread, before the training step instead of after it.

Lightning runs ``training_step``, then ``zero_grad`` (on the first batch of an accumulation window), then
``backward``, so the previous step's gradients stay on the parameters through the forward, beside its activations
at their most; a pipeline schedule runs its backward inside ``training_step`` too, beside this step's gradients.
A loop that zeroes first (plain PyTorch, torchtitan) holds neither. They only need keeping where something reads
or keeps them.
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["release_unread_grads", "zero_grad_follows"]


def zero_grad_follows(trainer: Trainer) -> bool:
    """Whether Lightning zeroes the gradients right after every training step, unread: no accumulation over
    batches, backward not skipped, and no ``on_before_zero_grad`` or ``optimizer_zero_grad`` of the module's or a
    callback's own that could read them or keep some. Then the previous step's gradients can be released before
    the step instead of held through its forward (under a pipeline, beside this step's through the schedule).
    Under accumulation they are kept on every batch: the later batches of a window need them, so releasing them
    on the first would not lower the peak."""
    module = trainer.lightning_module
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    # Lightning's flag (SWA's callback sets it); where a version lacks it, nothing is released.
    if not module.automatic_optimization or trainer.accumulate_grad_batches != 1 or getattr(loop, "_skip_backward", True):
        return False
    for name in ("on_before_zero_grad", "optimizer_zero_grad"):
        if getattr(type(module), name) is not getattr(LightningModule, name) or name in vars(module):
            return False
    return all(type(cb).on_before_zero_grad is Callback.on_before_zero_grad for cb in trainer.callbacks)


def release_unread_grads(trainer: Trainer) -> None:
    """Drop what Lightning's default ``zero_grad`` (``set_to_none``) would after this step: the gradients of the
    optimizers' parameters. Any other parameter's gradient accumulates under Lightning, so it stays."""
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
