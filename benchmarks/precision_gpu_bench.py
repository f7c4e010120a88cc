"""GPU precision benchmark: tokens/s, MFU and loss of the example GPT scaled up, BF16 against FP8, side by side.

Needs one CUDA GPU (H100/H200 class for FP8). Run from the repository root:
    python -m benchmarks.precision_gpu_bench                 # both shapes, 60 steps each
    python -m benchmarks.precision_gpu_bench --steps 4 --shapes tiny --out /tmp/p.json   # smoke test
Writes benchmarks/results/precision_gpu.json. Each shape is trained twice from the same seed and data, once
with BF16Precision (mixed) and once with FP8Precision (tensorwise, bf16 base); blocks are compiled
(torch.compile) in both, so the comparison is of the matmul precision alone. MFU comes from the
ThroughputAndMemory callback: model FLOPs per device against the device's dense peak for the compute dtype.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.callbacks.throughput import ThroughputAndMemory
from lightning_llmpar.data import CorpusDataModule
from lightning_llmpar.models import GPTModule
from lightning_llmpar.precision.plugins import BF16Precision, FP8Precision

OUT = Path(__file__).parent / "results" / "precision_gpu.json"
# ~1B parameters at width 2048; the FP8 target is stated for width >= 4096 (matmuls big enough that
# the cast overhead is amortized).
SHAPES: dict[str, dict[str, int]] = {
    "1b_d2048": dict(n_layer=20, n_head=16, n_kv_head=8, n_embd=2048, block_size=2048),
    "d4096": dict(n_layer=6, n_head=32, n_kv_head=8, n_embd=4096, block_size=2048),
    "tiny": dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=256, block_size=256),
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _StepTimes(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        _sync()
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, *args: Any) -> None:
        _sync()
        self.times.append(time.perf_counter() - self._t)
        self.losses.append(float(outputs["loss"]))


def run(shape: str, precision: str, steps: int, batch: int, accelerator: str = "cuda", compile: bool = True) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    cfg = SHAPES[shape]
    module = GPTModule(vocab_size=256, learning_rate=3e-4, warmup_steps=10, total_steps=steps, **cfg)
    for block in module.model.layers if compile else []:
        block.compile()
    plugin = BF16Precision() if precision == "bf16" else FP8Precision(recipe="tensorwise", base="bf16-mixed")
    times, throughput = _StepTimes(), ThroughputAndMemory(log_every_n_steps=max(1, steps // 2))
    trainer = Trainer(
        accelerator=accelerator, devices=1, strategy=LLMParallelStrategy(), plugins=[plugin], max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[times, throughput],
    )
    trainer.fit(module, datamodule=CorpusDataModule(block_size=cfg["block_size"], batch_size=batch))
    warm = times.times[steps // 3 :]  # compilation and autotuning happen in the first steps
    step_time = sorted(warm)[len(warm) // 2]
    tokens_per_sec = batch * cfg["block_size"] / step_time
    flops = throughput.flops_per_token or 0.0
    peak = throughput.peak_flops
    return {
        "shape": shape, "precision": precision, "params": sum(p.numel() for p in module.parameters()),
        "converted_fp8_linears": len(getattr(plugin, "converted", [])),
        "median_step_s": step_time, "tokens_per_sec": tokens_per_sec,
        "tflops_per_device": flops * tokens_per_sec / 1e12, "peak_tflops": peak / 1e12 if peak else None,
        "mfu": flops * tokens_per_sec / peak if peak else None,
        "final_loss_mean_last5": sum(times.losses[-5:]) / len(times.losses[-5:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--shapes", nargs="+", default=["1b_d2048", "d4096"], choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--cpu-smoke", action="store_true", help="check the script on CPU (no compile, no figures)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        raise SystemExit("precision_gpu_bench needs a CUDA GPU (or --cpu-smoke to check the script itself).")
    accelerator, compile = ("cpu", False) if args.cpu_smoke else ("cuda", True)
    rows = [run(s, p, args.steps, args.batch, accelerator, compile) for s in args.shapes for p in ("bf16", "fp8")]
    summary = {}
    for shape in args.shapes:
        bf16, fp8 = (next(r for r in rows if r["shape"] == shape and r["precision"] == p) for p in ("bf16", "fp8"))
        summary[shape] = {
            "fp8_over_bf16_tokens_per_sec": fp8["tokens_per_sec"] / bf16["tokens_per_sec"],
            "fp8_loss_rel_diff": abs(fp8["final_loss_mean_last5"] - bf16["final_loss_mean_last5"])
            / bf16["final_loss_mean_last5"],
            "bf16_mfu": bf16["mfu"],
        }
    result = {
        "device": torch.cuda.get_device_name(0) if accelerator == "cuda" else platform.processor() or "cpu", "torch": torch.__version__, "host": platform.node(),
        "steps": args.steps, "batch": args.batch, "runs": rows, "summary": summary,
        "targets": {"bf16_mfu": ">= 0.50", "fp8_over_bf16_tokens_per_sec_at_d4096": ">= 1.3", "fp8_loss_rel_diff": "<= 0.01"},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
