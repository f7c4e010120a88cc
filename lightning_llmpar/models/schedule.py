"""The learning-rate schedule the example modules share: linear warm-up, then cosine decay to 10%."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["adamw_warmup_cosine"]


def adamw_warmup_cosine(params: Any, lr: float, warmup_steps: int, total_steps: int, **adamw: Any) -> dict[str, Any]:
    """``configure_optimizers``' return value: AdamW stepped per optimizer step by the schedule."""
    optimizer = torch.optim.AdamW(params, lr=lr, **adamw)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
