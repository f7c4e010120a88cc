"""What the benchmarks share: fixed random token windows dealt to data-parallel ranks in a fixed order, and a
step timer."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar.data import ordered_loader

__all__ = ["StepTimer", "TokenData"]


class TokenData(LightningDataModule):
    """``n`` random windows of ``seq`` tokens below ``vocab`` (inputs, next-token targets); no shuffling."""

    def __init__(self, batch_size: int, n: int = 256, vocab: int = 64, seq: int = 16, seed: int = 1234) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
        self.data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return ordered_loader(self.data, self.batch_size, self.trainer.strategy)


class StepTimer(Callback):
    """Wall seconds of each training batch, from its start to its end (``times``)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t)
