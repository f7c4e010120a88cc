"""A byte-level language-modelling corpus that needs no download: the Python standard library's source.

Every machine that runs Python has these files, so the main job trains on real text offline. Bytes
are the tokens (vocabulary 256), so no tokenizer has to be fetched either.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from lightning_llmpar.fault_tolerance.sampler import ResumableDataLoader, ResumableDistributedSampler

__all__ = ["CorpusDataModule", "load_corpus", "ordered_loader", "VOCAB_SIZE"]

VOCAB_SIZE = 256


def load_corpus(source: str | None = None, max_bytes: int = 2_000_000) -> Tensor:
    """Bytes of ``source`` (a file or a folder of ``*.py``/``*.txt``; default: the stdlib), as int64 tokens."""
    root = Path(source) if source else Path(sysconfig.get_paths()["stdlib"])
    if root.is_file():
        files = [root]
    else:
        files = sorted(p for p in root.glob("*") if p.suffix in (".py", ".txt") and p.is_file())
    if not files:
        raise ValueError(f"No *.py or *.txt files found in {root}; pass `source=` a text file or folder.")
    chunks, size = [], 0
    for path in files:  # sorted: the same corpus on every rank and every run
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


class _Windows(Dataset):
    """Non-overlapping windows of ``block_size`` inputs and the same shifted by one as targets."""

    def __init__(self, tokens: Tensor, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size
        self.length = (len(tokens) - 1) // block_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = i * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


class _PackedWindows(Dataset):
    """Rows of packed documents: the corpus cut into documents at every blank line (paragraphs: a Python file's
    functions and blocks), read in windows of ``block_size``. A row's documents restart their ``position_ids`` at 0 (a window
    starts one too); a document's last token has no target (-100), so nothing is predicted across documents."""

    def __init__(self, tokens: Tensor, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size
        self.length = (len(tokens) - 1) // block_size
        newline = tokens == 10
        starts = torch.zeros_like(tokens, dtype=torch.bool)
        starts[2:] = newline[:-2] & newline[1:-1]  # the token after two newlines
        self.starts = starts

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        start, end = i * self.block_size, (i + 1) * self.block_size
        starts = self.starts[start:end].clone()
        starts[0] = True
        index = torch.arange(self.block_size)
        positions = index - torch.where(starts, index, 0).cummax(0).values
        targets = torch.where(self.starts[start + 1 : end + 1], -100, self.tokens[start + 1 : end + 1])
        return {"input_ids": self.tokens[start:end], "targets": targets, "position_ids": positions}


def ordered_loader(dataset: Dataset, batch_size: int, strategy: Any, drop_last: bool = False) -> DataLoader:
    """Batches in a fixed order for ``strategy``: data-parallel rank r takes samples r, r+dp, ... (no shuffling),
    so the data-parallel ranks together see exactly one process's batches. Lightning's own training sampler
    always shuffles; parity checks and measurements need this one (with ``use_distributed_sampler=False``)."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    sampler = DistributedSampler(dataset, shuffle=False, **kwargs) if kwargs else None
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last)


VAL_MULTIPLE = 64  # the held-out windows are trimmed to a multiple of this


class CorpusDataModule(LightningDataModule):
    """Train/validation split of the corpus. ``packed``: rows of several documents each (dict batches with
    restarting ``position_ids``, see _PackedWindows).

    Training batches follow one shuffled order per epoch (``seed`` + epoch) dealt out to the data-parallel ranks, so
    every layout trains on one process's batches (at the same global batch), and the position in the epoch is
    saved with checkpoints (``DataPosition``, which `llmpar fit` adds): a run resumed mid-epoch goes on with the
    epoch's remaining samples."""

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 8,
        source: str | None = None,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        packed: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        self.save_hyperparameters()
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        tokens = load_corpus(hp.source, hp.max_bytes)
        split = int(len(tokens) * (1 - hp.val_fraction))
        windows = _PackedWindows if hp.packed else _Windows
        self.train_set = windows(tokens[:split], hp.block_size)
        val = windows(tokens[split:], hp.block_size)
        if len(val) == 0:
            raise ValueError(
                f"The validation split ({len(tokens) - split} bytes) is shorter than one block ({hp.block_size})."
                " Raise max_bytes or val_fraction."
            )
        # A whole number of windows per data-parallel rank, up to 64 ranks (powers of two): Lightning's in-order
        # DistributedSampler would otherwise repeat windows to even the ranks out, and the validation figures would
        # differ from one process's.
        self.val_set = Subset(val, range(len(val) - len(val) % VAL_MULTIPLE)) if len(val) >= VAL_MULTIPLE else val

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        strategy = self.trainer.strategy if self.trainer is not None else None
        ranks = getattr(strategy, "distributed_sampler_kwargs", None) or {}  # data-parallel size and rank
        sampler = ResumableDistributedSampler(self.train_set, shuffle=True, seed=self.hparams.seed, **ranks)
        return ResumableDataLoader(self.train_set, batch_size=self.hparams.batch_size, sampler=sampler,
                                   num_workers=self.hparams.num_workers, drop_last=True, trainer=self.trainer)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)

    # `llmpar test` and `llmpar predict` read the held-out split too (predictions: the next token at each position).
    test_dataloader = predict_dataloader = val_dataloader
