"""Packed documents train exactly as the same documents one per row with padding: per-token losses in one process,
and losses at every step with first-step gradients (SGD) under TP, PP and ZeRO; context parallelism refuses packed
rows before work. transformers' Llama (SDPA, its default key/value cache on) and the example GPT (boundaries as
position_ids or as document_ids)."""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset

from lightning_llmpar.models.gpt import GPT, GPTConfig
from lightning_llmpar.training.documents import apply_document_masking
from tests.distributed import run_ranks
from tests.zoo import Record, assert_exact

pytest.importorskip("transformers")

VOCAB, SEQ, ROWS, STEPS = 64, 16, 4, 6  # 4 packed rows a step, 3 documents each: 12 padded rows


def _documents(steps: int = STEPS) -> list[list[torch.Tensor]]:
    """Per packed row, 3 documents whose lengths add up to SEQ (each row has SEQ - 3 targets)."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(steps * ROWS):
        a = int(torch.randint(2, SEQ - 4, (1,), generator=g))
        b = int(torch.randint(2, SEQ - a - 1, (1,), generator=g))
        rows.append([torch.randint(2, VOCAB, (n,), generator=g) for n in (a, b, SEQ - a - b)])
    return rows


def packed_row(docs: list[torch.Tensor], style: str) -> dict[str, torch.Tensor]:
    """One row of ``docs``: 'hf' (labels -100 at each document's first token, as transformers' padding-free
    collator), 'gpt' (shifted targets, -100 at each document's last token) or 'gpt_ids' (document_ids instead)."""
    ids = torch.cat(docs)
    positions = torch.cat([torch.arange(len(d)) for d in docs])
    if style == "hf":
        return {"input_ids": ids, "labels": torch.where(positions == 0, -100, ids), "position_ids": positions}
    targets = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])
    if style == "gpt_ids":
        return {"input_ids": ids, "targets": targets,
                "document_ids": torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])}
    return {"input_ids": ids, "targets": targets, "position_ids": positions}


def padded_row(doc: torch.Tensor, style: str) -> dict[str, torch.Tensor]:
    n, pad = len(doc), SEQ - len(doc)
    ids = torch.cat([doc, torch.zeros(pad, dtype=torch.long)])
    keep = torch.arange(SEQ) < n
    if style == "hf":
        return {"input_ids": ids, "labels": torch.where(keep, ids, -100), "attention_mask": keep.long()}
    targets = torch.cat([doc[1:], torch.full((pad + 1,), -100)])
    return {"input_ids": ids, "targets": targets}


class _Batches(Dataset):
    """One whole step's batch per item (a DataLoader with batch_size=None): packed rows or the padded documents."""

    def __init__(self, style: str, packed: bool) -> None:
        rows = _documents()
        self.items = []
        for step in range(STEPS):
            group = rows[step * ROWS:(step + 1) * ROWS]
            samples = [packed_row(r, style) for r in group] if packed else [padded_row(d, style) for r in group for d in r]
            self.items.append({k: torch.stack([s[k] for s in samples]) for k in samples[0]})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


class _Data(LightningDataModule):
    def __init__(self, style: str, packed: bool) -> None:
        super().__init__()
        self.style, self.packed = style, packed

    def train_dataloader(self) -> DataLoader:
        data = _Batches(self.style, self.packed)
        dp = self.trainer.strategy.distributed_sampler_kwargs if hasattr(self.trainer.strategy, "layout") else None
        if dp and dp["num_replicas"] > 1:  # each data-parallel rank: its rows of every step
            return DataLoader(_Slice(data, dp["rank"], dp["num_replicas"]), batch_size=None)
        return DataLoader(data, batch_size=None)


class _Slice(Dataset):
    def __init__(self, data: _Batches, rank: int, replicas: int) -> None:
        self.data, self.rank, self.replicas = data, rank, replicas

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[self.rank::self.replicas] for k, v in self.data[i].items()}


class _HF(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        config._attn_implementation = "sdpa"  # use_cache stays True, as a user's config has it
        self.model = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _GPT(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        boundaries = {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}
        logits = self.model(batch["input_ids"], **boundaries)
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(style: str, packed: bool, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    from lightning_llmpar import LLMParallelStrategy

    seed_everything(0, verbose=False)
    record = Record()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(accelerator="cpu", devices=1 if kwargs is None else world, max_steps=STEPS, logger=False,
                      strategy="auto" if kwargs is None else LLMParallelStrategy(**kwargs), callbacks=[record],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False)
    trainer.fit(_HF() if style == "hf" else _GPT(), datamodule=_Data(style, packed))
    return {"losses": record.losses, "grads": record.grads, "held": 0.0}


def _fits(cases: list[tuple]) -> dict[tuple, Any]:
    env, out = dict(os.environ), {}
    for case in cases:
        os.environ.update(env)
        try:
            out[case[:2] + (repr(case[2]),)] = _fit(*case)
        except Exception:  # noqa: BLE001 - each case reports its own error
            out[case[:2] + (repr(case[2]),)] = {"error": traceback.format_exc()}
    return out


def _per_token(model: Any, batch: dict[str, torch.Tensor], style: str) -> torch.Tensor:
    """Every valid target's loss, in document order."""
    if style == "hf":
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        targets = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], dim=1)
    else:
        logits = model(batch["input_ids"], **{k: batch[k] for k in ("position_ids", "document_ids") if k in batch})
        targets = batch["targets"]
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return losses[targets.reshape(-1) != -100]


@pytest.mark.parametrize("style", ["hf", "gpt", "gpt_ids"])
def test_packed_rows_give_the_padded_documents_per_token_losses_and_gradients(style: str) -> None:
    torch.manual_seed(0)
    model = (_HF() if style == "hf" else _GPT()).model.train()
    assert apply_document_masking(model) == (2 if style == "hf" else 0)  # the CausalLM and its base model
    packed, padded = _Batches(style, True)[0], _Batches(style, False)[0]
    grads = []
    for batch in (packed, padded):
        model.zero_grad()
        losses = _per_token(model, batch, style)
        losses.mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if batch is packed:
            first = losses.detach()
    torch.testing.assert_close(first, losses.detach(), atol=1e-5, rtol=0)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


LAYOUTS = {"tp2": {"tensor_parallel": 2}, "pp2": {"pipeline_parallel": 2, "pipeline_schedule": "1F1B"},
           "dp2-zero3": {"zero_stage": 3}, "cp2-ulysses": {"context_parallel": 2, "context_parallel_mode": "ulysses"}}
RING = {"context_parallel": 2}


def test_packed_rows_are_exact_under_tp_pp_zero_and_ulysses() -> None:
    styles = ["hf", "gpt", "gpt_ids"]
    refs = run_ranks(_fits, 1, [(s, False, None) for s in styles], timeout=600)[0]
    cases = [(s, True, kw) for s in ("hf", "gpt") for kw in LAYOUTS.values()] + [("gpt_ids", True, LAYOUTS["tp2"])]
    cases += [("gpt_ids", True, LAYOUTS["cp2-ulysses"])]
    cases += [(s, True, RING) for s in ("hf", "gpt")]
    outs = run_ranks(_fits, 2, cases, timeout=900)
    for style, packed, kwargs in cases[:-2]:
        assert_exact(refs[(style, False, "None")], [o[(style, packed, repr(kwargs))] for o in outs], sharded=False)
    for style, packed, kwargs in cases[-2:]:  # ring attention: refused before work, with the reason
        errors = [o[(style, packed, repr(kwargs))].get("error", "") for o in outs]
        assert all("packs several documents in a row" in e and "mode='ulysses'" in e for e in errors), \
            errors[0][-1500:]


def _masked_hf_model() -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
    """transformers' Llama in training mode with document masking, a packed batch, and its per-token losses."""
    torch.manual_seed(0)
    model = _HF().model.train()
    apply_document_masking(model)
    packed = _Batches("hf", True)[0]
    return model, packed, _per_token(model, packed, "hf")


def test_transformers_packed_rows_with_an_attention_mask() -> None:
    # An all-ones attention_mask beside packed positions (some collators add one) says nothing: left out, so
    # transformers still masks the documents; one with padding cannot be honoured with packing and is refused.
    model, packed, expected = _masked_hf_model()
    ones = {**packed, "attention_mask": torch.ones_like(packed["input_ids"])}
    torch.testing.assert_close(_per_token(model, ones, "hf"), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="pads\\s+too .* Pack without padding"):
        _per_token(model, {**ones, "attention_mask": ones["attention_mask"].tril(8)[:, :SEQ]}, "hf")


def test_transformers_packed_rows_are_masked_in_evaluation_too() -> None:
    # Validation forwards keep the config's key/value cache unless told otherwise: packed documents attended across
    # their boundaries there (val_loss 0.01 off the per-document loss at cp2), and a monitored checkpoint chose
    # another step.
    model, packed, expected = _masked_hf_model()
    with torch.no_grad():
        torch.testing.assert_close(_per_token(model.eval(), packed, "hf"), expected, atol=1e-6, rtol=0)


def _fit_padded_packed_rows() -> str:
    """Ulysses cp2 on packed rows padded at the end (attention_mask zeros): the error each rank raises."""
    batch = _Batches("hf", True)[0]
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][:, -2:] = 0  # on the second context-parallel rank's part only
    try:
        _fit_batches([batch], {"context_parallel": 2, "context_parallel_mode": "ulysses"})
    except ValueError as err:
        return str(err)
    return ""


def _fit_batches(batches: list[dict[str, torch.Tensor]], kwargs: dict[str, Any]) -> None:
    from lightning_llmpar import LLMParallelStrategy

    trainer = Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, strategy=LLMParallelStrategy(**kwargs),
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False)
    trainer.fit(_HF(), train_dataloaders=DataLoader(batches, batch_size=None))


def test_packed_rows_with_padding_are_refused_on_every_context_parallel_rank() -> None:
    # Each rank's forward sees its part of the rows: refused by the rank whose part held both a document start and
    # padding, the other waited in the all-to-all until gloo gave up (2 minutes, "Connection closed by peer").
    errors = run_ranks(_fit_padded_packed_rows, 2, timeout=300)
    assert all("packs several documents in a row" in e for e in errors), errors


def test_tokens_normalization_counts_the_bundled_packed_rows() -> None:
    # loss_normalization='tokens' counts a dict's 'targets' (already shifted, -100 at each document's end), as the
    # bundled packed rows and the example GPT use them; 'labels' are shifted by one as transformers does.
    from lightning_llmpar.data import CorpusDataModule
    from lightning_llmpar.training.loss_normalization import count_target_tokens

    data = CorpusDataModule(block_size=64, batch_size=4, max_bytes=20_000, packed=True)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    ignored = int((batch["targets"] == -100).sum())
    assert ignored > 0 and count_target_tokens(batch) == batch["targets"].numel() - ignored
    labels = torch.tensor([[5, 6, -100, 7]])
    assert count_target_tokens({"labels": labels}) == 2 and count_target_tokens((labels, labels)) == 3
    # Unshifted where the model's loss takes every label (T5, BERT), and a sample's class label never shifts: a
    # one-sample microbatch of a classifier counted 0.
    assert count_target_tokens({"labels": labels}, shifted=False) == 3
    assert count_target_tokens({"labels": torch.tensor([4])}) == 1


@pytest.mark.parametrize("packed", [False, True])
def test_bundled_validation_windows_divide_over_data_parallel_ranks(packed: bool) -> None:
    # Lightning's in-order DistributedSampler repeats windows to even out ranks that do not divide them, and the
    # validation figures then differ from one process's: the main job (dp2) warned of 781 windows.
    from lightning_llmpar.data import VAL_MULTIPLE, CorpusDataModule

    data = CorpusDataModule(block_size=128, packed=packed)
    data.setup("fit")
    assert len(data.val_set) >= VAL_MULTIPLE and len(data.val_set) % VAL_MULTIPLE == 0
    small = CorpusDataModule(block_size=128, max_bytes=40_000, packed=packed)
    small.setup("fit")
    assert 0 < len(small.val_set) < VAL_MULTIPLE  # too few to trim: kept whole
