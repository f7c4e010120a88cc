"""Batches as users build them, under pipeline parallelism: the microbatches are the batch's rows in its own
structure (dicts with per-sample lists, dataclasses, named tuples), and the same-batch check sees into all of them."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.models import GPTModule
from lightning_llmpar.training.batches import batch_rows, batch_tensors
from tests.distributed import run_ranks

Pair = namedtuple("Pair", ["ids", "names"])


@dataclasses.dataclass
class Rows:
    ids: torch.Tensor
    names: list[str]
    scale: float = 1.0


def test_rows_keep_the_structure_and_split_per_sample_lists() -> None:
    ids = torch.arange(12).view(4, 3)
    batch = {"input_ids": ids, "names": ["a", "b", "c", "d"], "shared": torch.ones(1, 3), "pair": Pair(ids, "x")}
    rows = batch_rows(batch, 2, 4, 4)
    assert torch.equal(rows["input_ids"], ids[2:]) and rows["names"] == ["c", "d"]
    assert rows["shared"].shape == (1, 3) and torch.equal(rows["pair"].ids, ids[2:]) and rows["pair"].names == "x"
    data = batch_rows(Rows(ids, list("abcd"), 2.0), 0, 2, 4)
    assert isinstance(data, Rows) and torch.equal(data.ids, ids[:2]) and data.names == ["a", "b"] and data.scale == 2.0
    two = ids[:2]
    pair = batch_rows((two, two), 1, 2, 2)  # a tuple of two tensors is structure, not two samples
    assert isinstance(pair, tuple) and len(pair) == 2 and torch.equal(pair[0], ids[1:2])
    # The same-batch fingerprint reads a dataclass's tensors (it read none: peers with other data passed).
    assert [t.data_ptr() for t in batch_tensors(Rows(ids, []))] == [ids.data_ptr()]


class _Named(GPTModule):
    """A step that reads per-sample names beside the token rows, as a collate function with metadata gives them."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, names = (batch.ids, batch.names) if isinstance(batch, Rows) else (batch["input_ids"], batch["names"])
        if names != [f"s{int(row[0])}" for row in ids]:
            raise AssertionError(f"names {names} for rows {[int(r[0]) for r in ids]}")
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def _fit(kind: str) -> list[float]:
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    samples = [torch.cat([torch.tensor([i]), torch.randint(0, 64, (16,))]) for i in range(16)]

    def collate(items: list[torch.Tensor]) -> Any:
        ids, names = torch.stack(items), [f"s{int(t[0])}" for t in items]
        return Rows(ids, names) if kind == "dataclass" else {"input_ids": ids, "names": names}

    losses: list[float] = []

    class Keep(_Named):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            losses.append(float(outputs["loss"]))

    trainer = Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                      strategy=LLMParallelStrategy(pipeline_parallel=2, pipeline_schedule="1F1B",
                                                   pipeline_microbatches=4))
    module = Keep(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_kv_head=2, n_embd=32)
    trainer.fit(module, DataLoader(samples, batch_size=8, collate_fn=collate))
    return losses


def test_microbatches_pair_per_sample_lists_with_their_rows() -> None:
    # Every microbatch held all 8 names beside its 2 rows; a dataclass batch was refused ("without a tensor").
    for kind in ("dict", "dataclass"):
        for losses in run_ranks(_fit, 2, kind):
            assert len(losses) == 2, losses
