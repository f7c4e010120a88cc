"""What validation logs with ``sync_dist=True`` and ``reduce_fx`` other than the mean, and torchmetrics sums, equal
one process's under tensor and pipeline parallelism: reduced over the ranks that hold different data, combined
over a pipeline's microbatches by the call's own ``reduce_fx`` (see training.sync_groups and pipeline.logs)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.models.gpt import GPT, GPTConfig
from tests.distributed import run_ranks

VOCAB = 128


class _Evaluated(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=4, n_head=4, n_kv_head=2, n_embd=32))
        self.count, self.mean = torchmetrics.SumMetric(), torchmetrics.MeanMetric()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        per_sample = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)
        self.log("samples", float(x.shape[0]), reduce_fx="sum", sync_dist=True)
        self.log("worst", per_sample.max(), reduce_fx="max", sync_dist=True)
        self.log("best", per_sample.min(), reduce_fx=torch.min, sync_dist=True)
        self.log("val_loss", per_sample.mean(), sync_dist=True)
        self.count.update(torch.tensor(float(x.shape[0])))
        self.mean.update(per_sample)
        self.log("count", self.count)
        self.log("mean", self.mean)


def _validate(strategy: dict[str, Any] | None) -> dict[str, float]:
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    data = torch.randint(0, VOCAB, (12, 17), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(accelerator="cpu", devices=1 if strategy is None else _world(strategy), logger=False,
                      strategy="auto" if strategy is None else LLMParallelStrategy(**strategy),
                      enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    return {k: float(v) for k, v in trainer.validate(_Evaluated(), loader, verbose=False)[0].items()}


@cache
def _one_process() -> dict[str, float]:
    return run_ranks(_validate, 1, None)[0]


def _world(strategy: dict[str, Any]) -> int:
    return (strategy.get("tensor_parallel", 1) * strategy.get("pipeline_parallel", 1) * strategy.get("data_parallel", 1)
            * strategy.get("context_parallel", 1))


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param({"tensor_parallel": 2}, id="tp2"),
        pytest.param({"pipeline_parallel": 2, "pipeline_schedule": "1F1B"}, id="pp2"),
        pytest.param({"tensor_parallel": 2, "pipeline_parallel": 2, "pipeline_schedule": "1F1B"}, id="tp2-pp2"),
        # Data-parallel ranks hold different samples: still reduced over (Lightning's sampler: 6 samples each).
        pytest.param({"tensor_parallel": 2, "data_parallel": 2, "zero_stage": 3}, id="dp2-tp2"),
        # Evaluation runs whole sequences on each context-parallel rank: copies, not parts (sums were doubled).
        pytest.param({"context_parallel": 2}, id="cp2"),
        pytest.param({"context_parallel": 2, "pipeline_parallel": 2, "pipeline_schedule": "1F1B"}, id="cp2-pp2"),
    ],
)
def test_sums_maxima_and_metrics_logged_in_validation_are_one_process(strategy: dict[str, Any]) -> None:
    expected = _one_process()
    assert expected["samples"] == 12.0 and expected["count"] == 12.0
    got = run_ranks(_validate, _world(strategy), strategy, timeout=300)
    for rank, values in enumerate(got):
        assert values.keys() == expected.keys()
        for key, want in expected.items():
            assert abs(values[key] - want) < 1e-5, f"rank {rank}: {key} {values[key]}, one process {want}"
