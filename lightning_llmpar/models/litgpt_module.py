"""Fine-tune a LitGPT model with Lightning: the module a user writes for one device.

The model is built in ``configure_model`` from a directory's ``model_config.yaml`` (LitGPT's own format), so
with ``LLMParallelStrategy(litgpt_checkpoint=DIR)`` it starts on the meta device and each rank loads only its
slices of ``lit_model.pth``. Needs ``litgpt`` (``pip install --no-deps litgpt``: its own pins conflict with
transformers 5; importing its model needs only torch and lightning).

``python -m lightning_llmpar.models.litgpt_module CONFIG_DIR OUT_DIR`` writes a randomly initialized LitGPT checkpoint
of that config (lit_model.pth + model_config.yaml), offline.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llmpar.models.finetune import FineTuneModule, random_checkpoint_command

__all__ = ["LitGPTModule", "write_random_litgpt_checkpoint"]


class LitGPTModule(FineTuneModule):
    """A LitGPT ``GPT`` built from ``model`` (a directory holding LitGPT's model_config.yaml)."""

    def __init__(
        self, model: str, learning_rate: float = 1e-3, weight_decay: float = 0.0, warmup_steps: int = 10,
        total_steps: int = 1000,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from litgpt import Config
        from litgpt.model import GPT

        self.model = GPT(Config.from_file(Path(self.hparams.model) / "model_config.yaml"))

    def _loss(self, batch: Any) -> Tensor:
        if isinstance(batch, dict):
            inputs, targets = batch["input_ids"][:, :-1], batch["labels"][:, 1:]
        else:
            inputs, targets = batch
        logits = self.model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100)



def write_random_litgpt_checkpoint(config_dir: str, out_dir: str, seed: int = 0) -> None:
    """A randomly initialized LitGPT checkpoint of ``config_dir``'s model_config.yaml (offline)."""
    from litgpt import Config
    from litgpt.model import GPT

    torch.manual_seed(seed)
    source = Path(config_dir) / "model_config.yaml"
    model = GPT(Config.from_file(source))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / "lit_model.pth")
    shutil.copy(source, out / "model_config.yaml")


if __name__ == "__main__":
    random_checkpoint_command(write_random_litgpt_checkpoint)
