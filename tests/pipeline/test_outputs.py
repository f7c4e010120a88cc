"""What a step returns under pipeline parallelism is what one process's returns: the last stage's microbatch
outputs merged into the batch's, in the structure the step returned (pipeline.logs.merge_outputs)."""

from __future__ import annotations

import warnings
from collections import namedtuple
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.models.gpt import GPT, GPTConfig
from tests.distributed import run_ranks

VOCAB = 128
Scored = namedtuple("Scored", ["ids", "score"])


class _Predicting(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=4, n_head=4, n_kv_head=2, n_embd=32))

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> Any:
        logits = self.model(batch[0])
        ids, score = logits.argmax(-1), logits[:, -1].max(-1).values
        # A tuple, a named tuple, a dict holding a list, and a number for the whole batch (a mean: averaged).
        return ids, Scored(ids, score), {"scores": [score, -score]}, score.mean()


def _predict(strategy: dict[str, Any] | None) -> tuple[list[Any], list[str]]:
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    data = torch.randint(0, VOCAB, (6, 16), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(accelerator="cpu", devices=1 if strategy is None else 2, logger=False,
                      strategy="auto" if strategy is None else LLMParallelStrategy(**strategy),
                      enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = trainer.predict(_Predicting(), DataLoader(TensorDataset(data), batch_size=4))
    return out, [str(w.message) for w in caught]


def _same(got: Any, want: Any, where: str) -> None:
    assert type(got) is type(want), f"{where}: {type(got).__name__}, one process {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype, (where, got.shape, want.shape, got.dtype)
        assert torch.allclose(got, want, atol=1e-5) if want.is_floating_point() else torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")


def test_predictions_keep_the_structure_one_process_returns() -> None:
    # Batches of 4 and 2 samples, each split into 2 microbatches: a tuple came back as a list of microbatch tuples.
    (want, _), = run_ranks(_predict, 1, None)
    for rank, (got, caught) in enumerate(run_ranks(_predict, 2, {"pipeline_parallel": 2, "pipeline_schedule": "1F1B"})):
        _same(got, want, f"rank {rank}")
        if rank == 1:  # the last stage, which holds the microbatch outputs
            assert any("averaged, which is right for a mean and not for a sum" in m for m in caught), caught


class _PredictingTwice(_Predicting):
    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> Any:
        return self.model(batch[0]).argmax(-1) + self.model(batch[0].flip(-1)).argmax(-1)  # two forwards


def _predict_twice(strategy: dict[str, Any]) -> str:
    torch.set_num_threads(1)
    trainer = Trainer(accelerator="cpu", devices=2, logger=False, strategy=LLMParallelStrategy(**strategy),
                      enable_progress_bar=False, enable_model_summary=False)
    data = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    try:
        trainer.predict(_PredictingTwice(), DataLoader(TensorDataset(data), batch_size=4))
    except Exception as error:  # the last stage raises; the first waits for it until the groups' timeout
        return f"{type(error).__name__}: {error}"
    return "(predicted without an error)"


def test_a_predict_step_that_calls_the_model_twice_is_told_so() -> None:
    # The message blamed the embedding for being "called after its blocks", not naming the step's second forward.
    message = run_ranks(_predict_twice, 2, {"pipeline_parallel": 2, "pipeline_schedule": "1F1B", "timeout": 10})[1]
    # The second forward leads the message (an embedding run after the blocks is rarely anything else).
    assert message.startswith("ValueError: Pipeline split: module") and "ran after the blocks had run" in message, message
    assert "the model a second time" in message.split(". ")[0] and "decode with pipeline_parallel=1" in message
    assert "concatenate the inputs into one batch" in message, message
