"""The data position a checkpoint holds, whichever callback saves it and in whatever order the callbacks run."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar.fault_tolerance.position import DataPosition
from lightning_llmpar.fault_tolerance.sampler import ResumableDistributedSampler

SAMPLES, BATCH = 32, 4


class _Recorder(LightningModule):
    """Trains a scalar on the sample indices and keeps which indices each step saw."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch[0].tolist())
        return (self.w - batch[0].float().mean()) ** 2

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.arange(SAMPLES))
        return DataLoader(data, batch_size=BATCH, sampler=ResumableDistributedSampler(data, seed=5))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _SaveAtStep(Callback):
    """A user's callback that saves a checkpoint at a batch's end, listed before ``DataPosition``."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _fit(callbacks: list[Callback], ckpt_path: Path | None = None) -> _Recorder:
    module = _Recorder()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                      callbacks=[*callbacks, DataPosition()])
    trainer.fit(module, ckpt_path=ckpt_path)
    return module


def test_a_checkpoint_saved_by_an_earlier_callback_resumes_after_its_step(tmp_path: Path) -> None:
    # DataPosition counted a batch in its own on_train_batch_end, so a callback ahead of it saved the position one
    # batch short: the resumed run trained step 3's samples again and never saw the epoch's last batch.
    whole = _fit([_SaveAtStep(3, tmp_path / "step3.ckpt")]).seen
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit([], ckpt_path=tmp_path / "step3.ckpt").seen
        # Silenced only until the first batch trained: a later resume without the position still warns.
        assert not [f for f in warnings.filters if getattr(f[1], "pattern", "").startswith("You're resuming")]
    assert resumed == whole[3:]
    # Lightning's warning that a mid-epoch resume of a loader it cannot restore is unreliable: this one is exact.
    assert not [w for w in caught if "resuming from a checkpoint that ended before" in str(w.message)]
