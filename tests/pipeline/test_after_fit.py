"""What a user gets from a pipeline-split module outside the steps (after fit, in a hook): each rank holds only
its stages, which its state dict and a direct call say instead of returning half a model or running on zeros."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.models import GPTModule
from tests.distributed import run_ranks


def _after_fit(folder: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    module = GPTModule(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_kv_head=2, n_embd=32)
    trainer = Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False,
                      strategy=LLMParallelStrategy(pipeline_parallel=2, pipeline_schedule="1F1B"))
    with warnings.catch_warnings(record=True) as during:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(TensorDataset(ids, ids), batch_size=4))
        trainer.save_checkpoint(f"{folder}/ckpt")  # the strategy's own read of each rank's part
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        keys = len(module.state_dict())
        module.state_dict()  # once is enough
    try:
        module(ids)
        called = "(ran)"
    except RuntimeError as error:
        called = str(error)
    partial = "holds only its pipeline stages"
    return {"keys": keys, "during": [str(w.message) for w in during if partial in str(w.message)],
            "after": [str(w.message) for w in after if partial in str(w.message)], "called": called}


def test_a_split_module_says_it_holds_a_part_when_read_or_called_outside_a_step(tmp_path: Path) -> None:
    # state_dict() gave rank 0 19 of 39 entries without a word (torch.save of it kept half a model); a call of
    # the module blamed the model's structure, and before a first step a later stage would have run on zeros.
    whole = len(GPTModule(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_kv_head=2, n_embd=32).state_dict())
    outs = run_ranks(_after_fit, 2, str(tmp_path))
    assert sum(o["keys"] for o in outs) >= whole > max(o["keys"] for o in outs)
    for rank, out in enumerate(outs):
        assert out["during"] == [], f"rank {rank}: warned on the run's own reads: {out['during']}"
        assert len(out["after"]) == 1, f"rank {rank}: {out['after']}"
        assert f"of the model's {whole} entries" in out["after"][0] and "export_consolidated" in out["after"][0]
        assert "held by another pipeline rank" in out["called"] and "trainer.predict" in out["called"], out["called"]
