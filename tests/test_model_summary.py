"""What Lightning's model summary prints and the FLOPs the throughput callback counts are the whole model's under
pipeline parallelism, as one process counts them: every stage's parameters, a weight tied across stages once."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelSummary

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.callbacks.throughput import ThroughputAndMemory
from tests.distributed import run_ranks
from tests.zoo import DictTokenData, HFCausalLM

pytest.importorskip("transformers")


class _Summary(ModelSummary):
    """Lightning's summary, its totals kept as printed (on global rank 0)."""

    printed: dict[str, Any] = {}

    @staticmethod
    def summarize(summary_data: Any, total_parameters: int, trainable_parameters: int, model_size: float,
                  total_training_modes: Any, total_flops: int = 0, **kwargs: Any) -> None:
        _Summary.printed.update(total=total_parameters, trainable=trainable_parameters, size=model_size)


class _WithExample(HFCausalLM):
    """A module with Lightning's ``example_input_array``, which the summary runs through it (under a pipeline a rank
    cannot: the fit failed at its start)."""

    def __init__(self) -> None:
        super().__init__("llama_tied")
        self.example_input_array = torch.zeros(2, 8, dtype=torch.long)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def _fit(strategy: dict[str, Any] | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    throughput = ThroughputAndMemory(log_every_n_steps=1, peak_flops=1e9)
    trainer = Trainer(accelerator="cpu", devices=1 if strategy is None else 2, max_steps=1, logger=False,
                      strategy="auto" if strategy is None else LLMParallelStrategy(**strategy),
                      enable_progress_bar=False, enable_checkpointing=False, callbacks=[_Summary(), throughput])
    module = _WithExample()
    module.model.model.layers[0].requires_grad_(False)  # a frozen block: trainable != total
    trainer.fit(module, datamodule=DictTokenData(4))
    return {**_Summary.printed, "flops_per_token": throughput.flops_per_token}


def test_summary_and_flops_count_every_stage_and_a_tied_weight_once() -> None:
    want = run_ranks(_fit, 1, None)[0]
    assert want["trainable"] < want["total"]
    got = run_ranks(_fit, 2, {"pipeline_parallel": 2, "pipeline_schedule": "1F1B"})[0]
    # Without the stages' sum rank 0 printed its own stage (about half); the tied head's copy added 6 x vocab x width.
    assert got == want
