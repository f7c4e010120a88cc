"""What the example fine-tuning modules share: their steps and logging, AdamW with linear warm-up then cosine decay
to 10%, and the command that writes a random checkpoint of a config."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

__all__ = ["FineTuneModule", "adamw_warmup_cosine", "random_checkpoint_command", "schedule_length"]


def schedule_length(module: LightningModule, total_steps: int) -> float:
    """The decay's length in optimizer steps: ``total_steps``, or where it is not set (<= 0: `llmpar fit` links
    ``trainer.max_steps`` into it, -1 when the run is bounded by epochs) the trainer's own count of the run's
    optimizer steps (epochs x batches / accumulation); ``inf`` when nothing bounds the run (the peak is held)."""
    if total_steps > 0:
        return total_steps
    trainer = module._trainer
    return float(trainer.estimated_stepping_batches) if trainer is not None else math.inf


def adamw_warmup_cosine(params: Any, lr: float, warmup_steps: int, total_steps: float, **adamw: Any) -> dict[str, Any]:
    """``configure_optimizers``' return value: AdamW stepped per optimizer step by the schedule (``total_steps``:
    see ``schedule_length``)."""
    optimizer = torch.optim.AdamW(params, lr=lr, **adamw)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


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
