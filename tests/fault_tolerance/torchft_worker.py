"""One replica group of the torchft tests: a tiny regression model trained by Lightning with LLMParallelStrategy.

Run as a script, one process per replica group (or one for the reference without torchft). Files under --out
are the only channel to the test: ``ready_<group>`` once this group's manager is up, ``<group>_<tag>.jsonl``
one line per optimizer step, ``<group>_<tag>.pt`` the final weights, ``<group>_<tag>_threads.json`` the names of
rank 0's threads after fit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.fault_tolerance import FaultTolerantCheckpoint, ResumableDistributedSampler


def lr_at(step: int) -> float:
    """The per-step schedule's factor after ``step`` optimizer steps."""
    return 1.0 / (1.0 + 0.05 * step)

class Regression(LightningModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(7)
        self.data = TensorDataset(torch.randn(4096, 8, generator=g), torch.randn(4096, 1, generator=g))

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)  # what a logger records, at which step (the CSV of --csv)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)  # momentum: healing must carry state
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)  # per step: must count committed steps only
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        # A fixed order (Lightning's own sampler would shuffle): the reference reads the same global batches.
        # ResumableDistributedSampler deals as DistributedSampler does, and FaultTolerantCheckpoint saves its position.
        sampler = ResumableDistributedSampler(self.data, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler)


class TiedLlama(Regression):
    """A transformers Llama built small from a config: tied embeddings, a frozen final norm, dict batches."""

    def __init__(self, batch_size: int) -> None:
        LightningModule.__init__(self)
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=True)
        self.model = LlamaForCausalLM(cfg)
        self.model.model.norm.weight.requires_grad_(False)
        self.batch_size = batch_size
        tokens = torch.randint(0, 64, (1024, 16), generator=torch.Generator().manual_seed(7))
        self.data = [{"input_ids": t, "labels": t} for t in tokens]

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        return self.model(**batch).loss


MODELS = {"regression": Regression, "llama_tied": TiedLlama}


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


class Script(Callback):
    """Start together, record every step, die or hold where the test says."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, Path(args.out)
        self._rows = (self.out / f"{args.group}_{args.tag}.jsonl").open("a")
        self._started = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Before the strategy's own on_train_start, where DiLoCo asks for its first quorum.
        (self.out / f"starting_{self.args.group}_{self.args.tag}").touch()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, idx: int) -> None:
        # Written right before the step asks for its first quorum (the manager has heartbeated since set-up); a
        # resumed run starts at a later batch of the epoch.
        if not self._started:
            self._started = True
            (self.out / f"ready_{self.args.group}_{self.args.tag}").touch()
            for other in self.args.wait_ready:
                _wait_for(self.out / f"ready_{other}", self.args.wait_timeout)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        chosen = self.args.kill_rank is None or trainer.global_rank == self.args.kill_rank
        if self.args.kill_at is not None and trainer.global_step == self.args.kill_at and chosen:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the forward is done, the gradient exchange is not

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int) -> None:
        if self.args.hold_at is not None and trainer.global_step == self.args.hold_at:
            (self.out / f"held_{self.args.group}_{self.args.tag}_{trainer.global_rank}").touch()
            _wait_for(self.out / self.args.hold_for, self.args.wait_timeout)
        # Where the weights are, exactly: the groups of a DiLoCo run part between syncs and meet at each one. Every
        # rank gathers its ZeRO shards (a collective), then rank 0 writes.
        weights_sum = sum(float((p.full_tensor() if isinstance(p, DTensor) else p).detach().double().sum())
                          for p in pl_module.parameters())
        if trainer.global_rank != 0:
            return
        replicas = trainer.strategy._replicas
        row: dict[str, Any] = {"global_step": trainer.global_step, "loss": float(outputs["loss"]), "time": time.time(),
                               "weights_sum": weights_sum, "lr": trainer.optimizers[0].param_groups[0]["lr"]}
        if replicas is not None:
            m = replicas.manager
            row.update(step=m.current_step(), participants=m.num_participants(),
                       committed=replicas.committed_steps, uncommitted=replicas.uncommitted_steps)

        self._rows.write(json.dumps(row) + "\n")
        self._rows.flush()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                   for k, v in pl_module.state_dict().items()}  # every rank gathers its ZeRO shards
        if trainer.global_rank == 0:
            torch.save(weights, self.out / f"{self.args.group}_{self.args.tag}.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--group", default="ref")
    p.add_argument("--tag", default="run")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--torchft", action="store_true")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=None, help="only this rank of the group dies (default: every rank)")
    p.add_argument("--hold-at", type=int, default=None)
    p.add_argument("--hold-for", default="")
    p.add_argument("--wait-ready", nargs="*", default=[])
    p.add_argument("--wait-timeout", type=float, default=240.0)
    p.add_argument("--diloco-every", type=int, default=None)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--checkpoint-every", type=int, default=None, help="FaultTolerantCheckpoint into <out>/ckpt_<group>")
    p.add_argument("--resume", action="store_true", help="fit(ckpt_path='last') from those checkpoints")
    p.add_argument("--model", choices=list(MODELS), default="regression")
    args = p.parse_args()
    seed_everything(0)
    diloco = {"data_parallel_sync": "diloco", "diloco_every": args.diloco_every, "diloco_outer_lr": args.outer_lr,
              "diloco_outer_momentum": args.outer_momentum} if args.diloco_every else {}
    strategy = LLMParallelStrategy(zero_stage=args.zero, fault_tolerance="torchft" if args.torchft else None, **diloco)
    callbacks: list[Callback] = [Script(args)]
    if args.checkpoint_every:
        callbacks.append(FaultTolerantCheckpoint(str(Path(args.out) / f"ckpt_{args.group}"), args.checkpoint_every))
    trainer = Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps, use_distributed_sampler=False,
        callbacks=callbacks, logger=CSVLogger(args.out, name=f"csv_{args.group}", version=args.tag),
        log_every_n_steps=1, enable_checkpointing=bool(args.checkpoint_every), enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MODELS[args.model](args.batch), ckpt_path="last" if args.resume else None)
    if trainer.global_rank == 0:  # what fit left running: torch names each gloo process group's worker threads
        tasks = Path("/proc/self/task")
        names = [(t / "comm").read_text().strip() for t in tasks.iterdir()] if tasks.is_dir() else []
        (Path(args.out) / f"{args.group}_{args.tag}_threads.json").write_text(json.dumps(names))


if __name__ == "__main__":
    main()
