"""The example GPT as an ordinary single-device LightningModule (no parallelism code in it)."""

from __future__ import annotations

import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics.text import Perplexity

from lightning_llmpar.models.finetune import adamw_warmup_cosine, schedule_length, warn_if_schedule_changed
from lightning_llmpar.models.gpt import GPT, GPTConfig

__all__ = ["GPTModule"]

Batch = tuple[Tensor, Tensor] | dict[str, Tensor]


class GPTModule(LightningModule):
    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_kv_head: int = 2,
        n_embd: int = 128,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        total_steps: int = 1000,
        n_expert: int = 0,
        n_expert_per_token: int = 2,
        moe_aux_loss_coef: float = 0.01,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(
            GPTConfig(
                vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                n_kv_head=n_kv_head, n_embd=n_embd, n_expert=n_expert, n_expert_per_token=n_expert_per_token,
            )
        )
        self.val_ppl = Perplexity(ignore_index=-100)
        self.test_ppl = Perplexity(ignore_index=-100)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def _logits(self, idx: Tensor, boundaries: dict[str, Tensor]) -> Tensor:
        # Packed rows' boundaries go to the model itself, whose forward takes them (this module's does not).
        return self.model(idx, **boundaries) if boundaries else self(idx)

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))  # targets -100: ignored

    @staticmethod
    def _unpack(batch: Batch) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
        """(inputs, targets) pairs, or dicts of packed rows: 'input_ids', 'targets' (shifted, -100 at each document's
        last token) and 'position_ids' restarting at each document or 'document_ids'."""
        if isinstance(batch, dict):
            boundaries = {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}
            return batch["input_ids"], batch.get("targets"), boundaries
        return batch[0], batch[1], {}

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, y, boundaries = self._unpack(batch)
        loss = self._loss(self._logits(x, boundaries), y)
        self.log("train/loss", loss, prog_bar=True)
        if self.hparams.n_expert and self.hparams.moe_aux_loss_coef:
            aux = self.model.aux_loss()
            self.log("train/aux_loss", aux)
            loss = loss + self.hparams.moe_aux_loss_coef * aux
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_ppl)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_ppl)

    def _evaluate(self, batch: Batch, stage: str, ppl: Perplexity) -> None:
        x, y, boundaries = self._unpack(batch)
        logits = self._logits(x, boundaries)
        ppl.update(logits.float(), y)
        self.log(f"{stage}/loss", self._loss(logits, y), sync_dist=True)
        self.log(f"{stage}/ppl", ppl, prog_bar=True)

    def predict_step(self, batch: Batch | Tensor, batch_idx: int) -> Tensor:
        if isinstance(batch, dict):
            x, _, boundaries = self._unpack(batch)
            return self._logits(x, boundaries).argmax(-1)
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(-1)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        warn_if_schedule_changed(self, checkpoint)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        hp = self.hparams
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        steps = schedule_length(self, hp.total_steps)
        return adamw_warmup_cosine(groups, hp.learning_rate, hp.warmup_steps, steps, betas=(0.9, 0.95))
