"""LLMParallelStrategy against plain Lightning on one device, fp32, SGD, the same batches: losses and gradients."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.models import GPTModule

__all__ = ["exactness"]


class _SGD(GPTModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Record(Callback):
    """Each step's loss, and every gradient before each optimizer step (full tensors, on the CPU)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer: Trainer, module: LightningModule, optimizer: Any) -> None:
        grads = {}
        for name, p in module.named_parameters():
            g = p.grad
            if g is not None:
                g = g.full_tensor() if hasattr(g, "full_tensor") else g
                grads[name] = g.detach().float().cpu().clone()
        self.grads.append(grads)


def _fit(strategy: Any, accelerator: str, model: dict[str, int], data: torch.Tensor, steps: int, batch: int) -> _Record:
    seed_everything(0, verbose=False)
    module = _SGD(**model)
    record = _Record()
    trainer = Trainer(accelerator=accelerator, devices=1, strategy=strategy, precision="32-true", max_steps=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0, callbacks=[record], use_distributed_sampler=False)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch, shuffle=False)
    trainer.fit(module, train_dataloaders=loader)
    return record


def exactness(accelerator: str, model: dict[str, int], steps: int = 4, batch: int = 4, tol: float = 1e-5) -> dict[str, Any]:
    """Train the same model twice from one seed on the same batches: with LLMParallelStrategy() and with
    Lightning's default strategy. Pass when every step's loss and every gradient agree within ``tol``
    (absolute, and relative to the largest gradient entry)."""
    if accelerator == "cuda":  # TF32 would make the two runs differ by their kernels' rounding, not the strategy
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    data = torch.randint(0, model["vocab_size"], (steps * batch, model["block_size"] + 1),
                         generator=torch.Generator().manual_seed(1))
    ours = _fit(LLMParallelStrategy(), accelerator, model, data, steps, batch)
    plain = _fit("auto", accelerator, model, data, steps, batch)
    loss_diff = max(abs(a - b) for a, b in zip(ours.losses, plain.losses))
    grad_diff, scale, missing = 0.0, 0.0, []
    for mine, theirs in zip(ours.grads, plain.grads):
        missing += sorted(set(theirs) ^ set(mine))
        for name in set(mine) & set(theirs):
            grad_diff = max(grad_diff, float((mine[name] - theirs[name]).abs().max()))
            scale = max(scale, float(theirs[name].abs().max()))
    passed = (len(ours.losses) == len(plain.losses) == steps and not missing and loss_diff <= tol
              and grad_diff <= tol * max(1.0, scale))
    return {"passed": passed, "tolerance": tol, "steps": steps, "losses_ours": ours.losses,
            "losses_plain_lightning": plain.losses, "max_loss_diff": loss_diff, "max_grad_diff": grad_diff,
            "max_grad_abs": scale, "mismatched_parameter_names": missing[:10], "model": model}
