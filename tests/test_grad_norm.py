"""``lightning_llmpar.grad_norm``: Lightning's ``grad_norm`` with one process's values under every layout.

Lightning's own, called in ``on_before_optimizer_step`` as its docs show, crashed on DTensor gradients (tensor
parallelism, ZeRO-3: "data is not allocated yet") and under pipeline parallelism logged rank 0's stage only
(1.586 where one process logs 2.2206).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule

from tests.distributed import run_ranks

LAYOUTS = {"tp2": {"tensor_parallel": 2}, "zero3": {"zero_stage": 3}, "pp2": {"pipeline_parallel": 2}}
# transformers' Llama with tied embeddings: at pp2 the tied weight lives on both stages and is counted once.
TIED = {"pp2": {"pipeline_parallel": 2, "pipeline_schedule": "1F1B"}, "tp2": {"tensor_parallel": 2}}


class _TiedLlama(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch[0]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def _first_step_norms(strategy: dict[str, Any] | None, model: str = "gpt") -> dict[str, float]:
    from lightning.pytorch import Callback, Trainer, seed_everything
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_llmpar import LLMParallelStrategy, grad_norm
    from lightning_llmpar.models import GPTModule

    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    tokens = torch.randint(0, 64, (16, 17), generator=torch.Generator().manual_seed(1))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    norms: dict[str, float] = {}

    class Norms(Callback):
        def on_before_optimizer_step(self, trainer: Trainer, module: Any, optimizer: Any) -> None:
            found = (grad_norm if strategy is not None else lightning_grad_norm)(module, norm_type=2)
            norms.update({k: float(v) for k, v in found.items()} if not norms else {})

    class Module(GPTModule if model == "gpt" else _TiedLlama):  # type: ignore[misc]
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            kwargs = self.trainer.strategy.distributed_sampler_kwargs if strategy is not None else {}
            dp = kwargs.get("num_replicas", 1)
            sampler = DistributedSampler(data, shuffle=False, **kwargs) if kwargs else None
            return DataLoader(data, batch_size=8 // dp, sampler=sampler)

    module = Module(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32) if model == "gpt" else Module()
    trainer = Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 1)) if strategy else 1,
                      strategy=LLMParallelStrategy(**strategy) if strategy is not None else "auto", max_steps=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, callbacks=[Norms()])
    trainer.fit(module)
    return norms


@pytest.fixture(scope="module")
def one_process() -> dict[str, float]:
    return run_ranks(_first_step_norms, 1, None)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grad_norm_is_one_process_grad_norm(one_process: dict[str, float], layout: str) -> None:
    assert len(one_process) > 10 and "grad_2.0_norm_total" in one_process
    for rank, norms in enumerate(run_ranks(_first_step_norms, 2, LAYOUTS[layout])):
        assert norms.keys() == one_process.keys(), f"rank {rank}: {sorted(set(norms) ^ set(one_process))}"
        for key, value in one_process.items():
            assert abs(norms[key] - value) <= 1e-5 * max(1.0, value), f"rank {rank} {key}: {norms[key]}, one process {value}"


@pytest.mark.parametrize("layout", list(TIED))
def test_grad_norm_of_a_tied_transformers_model_is_one_process_grad_norm(layout: str) -> None:
    pytest.importorskip("transformers")
    one = run_ranks(_first_step_norms, 1, None, "tied_llama")[0]
    assert "grad_2.0_norm/model.model.embed_tokens.weight" in one and "grad_2.0_norm_total" in one
    for rank, norms in enumerate(run_ranks(_first_step_norms, 2, TIED[layout], "tied_llama")):
        assert norms.keys() == one.keys(), f"rank {rank}: {sorted(set(norms) ^ set(one))}"
        for key, value in one.items():
            assert abs(norms[key] - value) <= 1e-5 * max(1.0, value), f"rank {rank} {key}: {norms[key]}, one process {value}"
