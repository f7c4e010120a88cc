"""Hugging Face benchmark: host memory and time to load pretrained weights, and training speed, side by side.

1. Loading. A Qwen3-like checkpoint (bf16 safetensors, as checkpoints are distributed) is loaded two ways:
   ``from_pretrained`` in one process (what each rank does without the strategy), and meta-device init +
   ``hf_checkpoint`` at tp2 x dp2 ZeRO-3, each rank reading only its slices. Recorded: every process's peak
   resident set (``ru_maxrss``, file pages it touched included) and the load time.
2. Speed. A ~100M-parameter Qwen3-like model trains a few steps in one process, at tp2 and at pp2, tokens/s.

Run from the repository root:  python -m benchmarks.hf_bench [--load-layers 48] [--speed-steps 4]
Writes benchmarks/results/hf.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from benchmarks.workloads import StepTimer
from lightning_llmpar.launch import run_ranks

OUT = Path(__file__).parent / "results" / "hf.json"


def _config(layers: int, hidden: int, intermediate: int, vocab: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=hidden // 64, num_key_value_heads=4, head_dim=64,
                       max_position_embeddings=1024, tie_word_embeddings=False, use_cache=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def write_checkpoint(path: str, layers: int, hidden: int, intermediate: int, vocab: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(layers, hidden, intermediate, vocab), dtype=torch.bfloat16)
    model.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    return {"parameters": params, "fp32_bytes": 4 * params, "bf16_bytes": 2 * params,
            "file_bytes": sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))}


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _lightning_module(path: str) -> Any:
    from lightning_llmpar.models import HFCausalLM

    return HFCausalLM(path)


def load_one_process(path: str) -> dict[str, float]:
    """What every rank does without the strategy: the whole model, in fp32, in host memory."""
    from transformers import AutoModelForCausalLM

    before = _peak_mb()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seconds = time.perf_counter() - start
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak_rss_mb": _peak_mb(), "rss_before_mb": before, "load_s": seconds, "param_bytes": held}


class _AtFitStart(Callback):
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.report: dict[str, float] = {}

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        from torch.distributed.tensor import DTensor

        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in pl_module.parameters())
        self.report = {"peak_rss_mb": _peak_mb(), "load_s": time.perf_counter() - self.start, "param_bytes": held}


def load_sharded(path: str, kwargs: dict[str, Any]) -> dict[str, float]:
    """Meta init in configure_model + hf_checkpoint: each rank materializes and reads only its shards."""
    from lightning_llmpar import LLMParallelStrategy

    before = _peak_mb()
    probe = _AtFitStart()
    trainer = Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=0, logger=False,
                      strategy=LLMParallelStrategy(hf_checkpoint=path, **kwargs), enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[probe])
    trainer.fit(_lightning_module(path), train_dataloaders=[{"input_ids": torch.zeros(1, 8, dtype=torch.long)}])
    return {**probe.report, "rss_before_mb": before}


def train_speed(path: str, kwargs: dict[str, Any] | None, steps: int, batch: int, seq: int) -> dict[str, float]:
    from lightning_llmpar import LLMParallelStrategy
    from lightning_llmpar.data import CorpusDataModule

    seed_everything(0, verbose=False)
    timer = StepTimer()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(2 if kwargs is None else 1)  # the same two cores in every layout
    trainer = Trainer(accelerator="cpu", devices=1 if kwargs is None else world, max_steps=steps, logger=False,
                      strategy="auto" if kwargs is None else LLMParallelStrategy(**kwargs), enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
                      limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(_lightning_module(path), datamodule=CorpusDataModule(block_size=seq, batch_size=batch, max_bytes=400_000))
    step = statistics.median(timer.times[1:]) if len(timer.times) > 1 else timer.times[0]
    return {"median_step_s": step, "tokens_per_s": batch * seq / step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load-layers", type=int, default=48)
    parser.add_argument("--load-hidden", type=int, default=1024)
    parser.add_argument("--speed-steps", type=int, default=4)
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hf_bench_"))
    result: dict[str, Any] = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}}
    try:
        big = str(root / "load")
        size = run_ranks(write_checkpoint, 1, big, args.load_layers, args.load_hidden, 4 * args.load_hidden, 32000,
                         timeout=1800)[0]
        one = run_ranks(load_one_process, 1, big, timeout=1800)[0]
        layout = {"tensor_parallel": 2, "zero_stage": 3}
        sharded = run_ranks(load_sharded, 4, big, layout, timeout=1800)
        worst = max(r["peak_rss_mb"] for r in sharded)
        result["load"] = {
            # Each of the 4 ranks holds (and reads) a quarter of the bf16 tensors.
            "checkpoint": {**size, "dtype": "bfloat16", "fp32_over_per_rank_shard": size["fp32_bytes"] / (size["bf16_bytes"] / 4)},
            "from_pretrained_one_process": one,
            "hf_checkpoint_tp2_dp2_zero3": {"ranks": sharded},
            "peak_rss_ratio": worst / one["peak_rss_mb"],
            "target": "<= 0.35",
        }
        print(json.dumps(result["load"], indent=1))
        if not args.skip_speed:
            small = str(root / "speed")
            result["speed_model"] = run_ranks(write_checkpoint, 1, small, 10, 768, 2048, 32000)[0]
            runs = {
                "one_process": run_ranks(train_speed, 1, small, None, args.speed_steps, 8, 256, timeout=3600)[0],
                "tp2": run_ranks(train_speed, 2, small, {"tensor_parallel": 2}, args.speed_steps, 8, 256, timeout=3600)[0],
                "pp2": run_ranks(train_speed, 2, small, {"pipeline_parallel": 2, "pipeline_schedule": "1F1B",
                                                          "pipeline_microbatches": 4}, args.speed_steps, 8, 256, timeout=3600)[0],
            }
            base = runs["one_process"]["tokens_per_s"]
            result["speed"] = {k: {**v, "vs_one_process": v["tokens_per_s"] / base} for k, v in runs.items()}
            print(json.dumps(result["speed"], indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
