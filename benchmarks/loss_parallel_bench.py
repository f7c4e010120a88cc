"""Loss parallelism, measured: the LM head's logits per rank, peak step memory and step time at a 128k vocabulary.

The example GPT with a 131,072-token vocabulary and a small body (2 blocks, d=64, 64 tokens, batch 2, fp32, SGD) at
tensor_parallel 1, 2 and 4, with loss_parallel on (the logits stay split over the vocabulary; the cross-entropy runs
in parallel) and off (the head gathers the full logits on every rank), side by side in one run:

- logits bytes per rank: what the LM head hands the training step on a rank (its local part when split);
- saved-for-backward bytes: what autograd keeps from the first step's forward until backward (each storage once,
  parameters left out);
- peak step memory: the most heap bytes in use during a training step above those in use when it began (glibc's
  mallinfo2, in-use small blocks plus mmapped ones, sampled every 0.2 ms from a thread), the largest rank's, the
  median over steps 2..N;
- step time: the median over steps 2..N, the slowest rank's.

Every rank runs one thread, so on a 2-core machine tp4 shares cores and its times are not speed-ups.

Run from the repository root:  python -m benchmarks.loss_parallel_bench [--steps 6] [--vocab 131072]
Writes benchmarks/results/loss_parallel.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time
import traceback
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "loss_parallel.json"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_in_use() -> Any:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return in_use


def _measure(steps: int, vocab: int, loss_parallel: bool | None) -> dict[str, Any]:
    """One run on this rank: the figures above for ``steps`` training steps."""
    import torch
    from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_llmpar import LLMParallelStrategy
    from lightning_llmpar.data import ordered_loader
    from lightning_llmpar.models import GPTModule

    seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    batch, seq = 2, 64
    in_use = _heap_in_use()

    class Data(LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(1234)
            tokens = torch.randint(0, vocab, (steps * batch, seq + 1), generator=g)
            return ordered_loader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch, self.trainer.strategy)

    class Module(GPTModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Measure(Callback):
        def __init__(self) -> None:
            self.logits_bytes = 0
            self.saved = 0
            self.peaks: list[int] = []
            self.times: list[float] = []
            self._seen: set[int] = set()
            self._hooks: Any = None

        def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
            def record(module: Any, args: Any, out: Any) -> None:
                local = out.to_local() if isinstance(out, DTensor) else out
                self.logits_bytes = local.numel() * local.element_size()

            pl_module.model.lm_head.register_forward_hook(record)

        def _pack(self, t: torch.Tensor) -> torch.Tensor:
            local = t.to_local() if isinstance(t, DTensor) else t
            ptr = local.untyped_storage().data_ptr()
            if ptr not in self._seen:  # parameters' storages are in _seen from the start
                self._seen.add(ptr)
                self.saved += local.untyped_storage().nbytes()
            return t

        def on_train_batch_start(self, trainer: Trainer, pl_module: Any, b: Any, idx: int) -> None:
            self.base, self.peak, self.sampling = in_use(), 0, True

            def sample() -> None:
                while self.sampling:
                    self.peak = max(self.peak, in_use() - self.base)
                    time.sleep(0.0002)

            self.sampler = threading.Thread(target=sample, daemon=True)
            self.sampler.start()
            if idx == 0:
                self._seen = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                              for p in pl_module.parameters()}
                self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
                self._hooks.__enter__()
            self.start = time.perf_counter()

        def on_before_backward(self, trainer: Trainer, pl_module: Any, loss: torch.Tensor) -> None:
            if self._hooks is not None:
                self._hooks.__exit__(None, None, None)
                self._hooks = None

        def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, b: Any, idx: int) -> None:
            self.times.append(time.perf_counter() - self.start)
            self.sampling = False
            self.sampler.join()
            self.peaks.append(self.peak)

    measure = Measure()
    strategy: Any = "auto" if loss_parallel is None else LLMParallelStrategy(
        tensor_parallel=world, loss_parallel=loss_parallel)
    module = Module(vocab_size=vocab, block_size=seq, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, callbacks=[measure], limit_val_batches=0)
    trainer.fit(module, datamodule=Data())
    return {"logits_bytes": measure.logits_bytes, "saved_bytes": measure.saved,
            "peak_bytes": statistics.median(measure.peaks[1:]), "step_s": statistics.median(measure.times[1:]),
            "full_logits_bytes": batch * seq * vocab * 4}


def _worker(rank: int, world: int, port: int, runs: list[tuple], queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", NODE_RANK="0")
    import torch

    torch.set_num_threads(1)
    env = dict(os.environ)
    try:
        rows = []
        for run in runs:
            os.environ.update(env)  # Lightning's teardown removes some launch variables
            rows.append(_measure(*run))
        queue.put((rank, rows))
    except BaseException:  # noqa: BLE001 - the parent prints it
        queue.put((rank, traceback.format_exc()))


def _launch(world: int, runs: list[tuple]) -> list[list[dict[str, Any]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, runs, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    errors = [v for v in results.values() if isinstance(v, str)]
    if errors:
        raise RuntimeError(errors[0])
    return [results[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=131072)
    args = parser.parse_args()
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": {"vocab_size": args.vocab, "n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 2, "batch": 2,
                  "seq": 64, "dtype": "float32", "optimizer": "SGD"},
        "steps": args.steps, "by_layout": {},
    }
    layouts = {1: [None], 2: [False, True], 4: [False, True]}
    for tp, options in layouts.items():
        per_rank = _launch(tp, [(args.steps, args.vocab, lp) for lp in options])
        for i, lp in enumerate(options):
            rows = [r[i] for r in per_rank]
            name = "tp1" if lp is None else f"tp{tp}_loss_parallel_{'on' if lp else 'off'}"
            full = rows[0]["full_logits_bytes"]
            logits = max(r["logits_bytes"] for r in rows)
            report["by_layout"][name] = {
                "tp": tp, "loss_parallel": bool(lp),
                "logits_mib_per_rank": round(logits / 2**20, 3), "logits_vs_full": round(logits / full, 4),
                "target_logits_vs_full": round(1 / tp, 4) if lp else 1.0,
                "saved_for_backward_mib": round(max(r["saved_bytes"] for r in rows) / 2**20, 2),
                "peak_step_mib": round(max(r["peak_bytes"] for r in rows) / 2**20, 2),
                "step_s": round(max(r["step_s"] for r in rows), 4),
            }
    for tp in (2, 4):
        on, off = report["by_layout"][f"tp{tp}_loss_parallel_on"], report["by_layout"][f"tp{tp}_loss_parallel_off"]
        report[f"tp{tp}_on_vs_off"] = {key: round(on[key] / off[key], 4) for key in
                                       ("logits_mib_per_rank", "saved_for_backward_mib", "peak_step_mib", "step_s")}
    import torch

    report["machine"]["torch"] = torch.__version__
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
