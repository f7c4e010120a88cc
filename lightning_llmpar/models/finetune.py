"""What the example fine-tuning modules share: their steps and logging, AdamW with linear warm-up then cosine decay
to 10%, and the command that writes a random checkpoint of a config."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

__all__ = ["FineTuneModule", "adamw_warmup_cosine", "random_checkpoint_command", "schedule_length",
           "warn_if_schedule_changed"]

SCHEDULE = ("learning_rate", "warmup_steps", "total_steps")  # the hyperparameters that make the schedule


def schedule_length(module: LightningModule, total_steps: int) -> float:
    """The decay's length in optimizer steps: ``total_steps``, or where it is not set (<= 0: `llmpar fit` links
    ``trainer.max_steps`` into it, -1 when the run is bounded by epochs) the trainer's own count of the run's
    optimizer steps (epochs x batches / accumulation); ``inf`` when nothing bounds the run (the peak is held)."""
    if total_steps > 0:
        return total_steps
    trainer = module._trainer
    return float(trainer.estimated_stepping_batches) if trainer is not None else math.inf


def warmup_cosine(step: int, warmup_steps: int, total_steps: float) -> float:
    """The learning rate's factor at optimizer step ``step``: linear warm-up, then cosine decay to 10%."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def adamw_warmup_cosine(params: Any, lr: float, warmup_steps: int, total_steps: float, **adamw: Any) -> dict[str, Any]:
    """``configure_optimizers``' return value: AdamW stepped per optimizer step by the schedule (``total_steps``:
    see ``schedule_length``)."""
    optimizer = torch.optim.AdamW(params, lr=lr, **adamw)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, warmup_steps, total_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def warn_if_schedule_changed(module: LightningModule, checkpoint: dict[str, Any]) -> None:
    """Say so when a run resumes with another schedule than its checkpoint's: the restored scheduler goes on with
    the new one, and the learning rate jumps where the run resumes (`llmpar fit` links ``total_steps`` to
    ``--trainer.max_steps``: a run extended from 5,000 to 10,000 steps resumes at step 5,000 at 55% of the peak
    where it had decayed to 10%). Nothing is refused: a longer schedule is what extending a run usually means."""
    saved = checkpoint.get("hyper_parameters") or {}
    hp = module.hparams
    changed = [f"{k} {saved[k]} -> {hp[k]}" for k in SCHEDULE if k in saved and k in hp and saved[k] != hp[k]]
    if not changed:
        return
    steps = [s.get("last_epoch") for s in checkpoint.get("lr_schedulers") or [] if isinstance(s, dict)]
    at = steps[0] if steps and isinstance(steps[0], int) else int(checkpoint.get("global_step", 0))
    old = {k: saved.get(k, hp[k]) for k in SCHEDULE}
    before = old["learning_rate"] * warmup_cosine(at, old["warmup_steps"], schedule_length(module, old["total_steps"]))
    now = hp.learning_rate * warmup_cosine(at, hp.warmup_steps, schedule_length(module, hp.total_steps))
    rank_zero_warn(f"Resuming at optimizer step {at} with another learning-rate schedule than the checkpoint's"
                   f" ({', '.join(changed)}; `llmpar fit` sets total_steps to --trainer.max_steps): the learning rate"
                   f" there is {now:.3g}, where the checkpoint's schedule has {before:.3g}.")


class FineTuneModule(LightningModule):
    """A module whose subclass builds ``self.model`` and computes ``_loss(batch)``; steps, logging (train/loss,
    val/loss, val/ppl) and the optimizer are the same for every example."""

    def _loss(self, batch: Any) -> Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/ppl", torch.exp(loss), sync_dist=True)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        warn_if_schedule_changed(self, checkpoint)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        return adamw_warmup_cosine(self.parameters(), hp.learning_rate, hp.warmup_steps,
                                   schedule_length(self, hp.total_steps), weight_decay=hp.weight_decay)


def random_checkpoint_command(write: Callable[[str, str, int], None]) -> None:
    """``python -m ... CONFIG_DIR OUT_DIR [--seed N]`` for a function writing a random checkpoint of a config."""
    parser = argparse.ArgumentParser(description=write.__doc__)
    parser.add_argument("config_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.config_dir, args.out_dir, args.seed)
    print(f"wrote {args.out_dir}")
