"""The nanoGPT step (`logits = model(x[:, :-1]); loss = ce(logits, x[:, 1:])`) under context parallelism: refused
before any update, naming the pattern and the fix, whatever the sequence length (no crash, no padding advice)."""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, Trainer, seed_everything
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar.context_parallel.sequence import shard_batch
from lightning_llmpar.models.gpt_module import GPTModule
from tests.distributed import run_ranks

PATTERN = "x[:, :-1]"
FIX = "(x[:-1], x[1:]) pairs"


@pytest.mark.parametrize("length", [17, 36, 33])
@pytest.mark.parametrize("wrap", ["tensor", "tuple", "dict"])
def test_one_sequence_without_targets_is_refused_with_the_pattern(length: int, wrap: str) -> None:
    x = torch.zeros(2, length, dtype=torch.long)
    batch = {"tensor": x, "tuple": (x,), "dict": {"input_ids": x, "attention_mask": torch.ones_like(x)}}[wrap]
    with pytest.raises(ValueError, match="no targets") as err:
        shard_batch(batch, 2, 0, "ring")
    assert PATTERN in str(err.value) and FIX in str(err.value) and "pad" not in str(err.value)


def test_inputs_with_targets_are_cut() -> None:
    x = torch.arange(32).reshape(2, 16)
    for batch in [(x, x + 1), {"input_ids": x, "labels": x}, {"input_ids": x, "targets": x + 1}]:
        _, shard = shard_batch(batch, 2, 0, "ring")
        assert shard is not None and shard.positions.shape == (2, 8)


class _NanoGPT(GPTModule):
    """The example GPT trained as nanoGPT does: one token sequence per sample, shifted inside the step."""

    def __init__(self) -> None:
        super().__init__(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0]
        logits = self(x[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _Sliced(_NanoGPT):
    """(inputs, targets) pairs in the batch, yet the step still slices the inputs."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y[:, 1:].reshape(-1))


class _Data(LightningDataModule):
    def __init__(self, *tensors: torch.Tensor) -> None:
        super().__init__()
        self.data = TensorDataset(*tensors)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4)


def _fit(kind: str, length: int) -> dict[str, Any]:
    from lightning_llmpar import LLMParallelStrategy

    seed_everything(0, verbose=False)
    tokens = torch.randint(0, 64, (8, length))
    module = _Sliced() if kind == "sliced" else _NanoGPT()
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    data = _Data(tokens, tokens) if kind == "sliced" else _Data(tokens)
    trainer = Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=2, logger=False,
                      strategy=LLMParallelStrategy(context_parallel=2), enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    error = ""
    try:
        trainer.fit(module, datamodule=data)
    except ValueError:
        error = traceback.format_exc()
    after = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in module.state_dict().items()}
    unchanged = all(torch.equal(after[k], before[k]) for k in before)
    return {"error": error, "unchanged": unchanged, "step": trainer.global_step}


def _fits(cases: list[tuple[str, int]]) -> dict[tuple[str, int], Any]:
    env = dict(os.environ)
    out = {}
    for case in cases:
        os.environ.update(env)
        out[case] = _fit(*case)
    return out


def test_shift_in_step_is_refused_before_any_update() -> None:
    # 36 = 4 x 9 once crashed inside the rotary embedding (17 vs 18); 33 was refused with padding advice.
    cases = [("nanogpt", 36), ("nanogpt", 33), ("sliced", 16)]
    outs = run_ranks(_fits, 2, cases, timeout=600)
    for out in outs:
        for case in cases:
            result = out[case]
            assert PATTERN in result["error"] and FIX in result["error"], (case, result["error"][-1500:])
            assert "pad on the right" not in result["error"]
            assert result["unchanged"] and result["step"] == 0, case
        assert "giving this rank 8 tokens of each, but the model was given 7" in out[("sliced", 16)]["error"]
