"""Fine-tune a Hugging Face causal LM with Lightning: the module a user writes for one device, nothing more.

The model is built in ``configure_model`` from a local directory's config.json, so under LLMParallelStrategy
with ``hf_checkpoint`` it is created on the meta device and each rank loads only its slices of the weights.
Batches are dicts (``input_ids``, ``labels``, optional ``attention_mask``: transformers' own loss) or
``(inputs, targets)`` pairs such as the bundled corpus yields.

``python -m lightning_llmpar.models.hf_causal_lm CONFIG_DIR OUT_DIR`` writes a randomly initialized "pretrained"
checkpoint of that config (config.json + safetensors), offline, to try the workflow without a download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llmpar.models.finetune import FineTuneModule, random_checkpoint_command

__all__ = ["HFCausalLM", "write_random_checkpoint"]


class HFCausalLM(FineTuneModule):
    """A transformers causal LM (``AutoModelForCausalLM``) built from ``model`` (a directory with config.json).

    Args:
        model: local directory holding the model's config.json (weights, if any, come from the strategy's
            ``hf_checkpoint``, usually the same directory).
        learning_rate, weight_decay, warmup_steps, total_steps: AdamW with linear warm-up and cosine decay.
        attn_implementation: transformers attention backend ('sdpa', 'eager', ...).
    """

    def __init__(
        self,
        model: str,
        learning_rate: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 10,
        total_steps: int = 1000,
        attn_implementation: str = "sdpa",
    ) -> None:
        super().__init__()
        path_like = model.startswith(("/", "./", "../", "~")) or model.count("/") > 1  # a Hub id has at most one
        if path_like and not Path(model).expanduser().is_dir():
            # transformers takes a missing path for a Hub id and says the id is malformed
            raise ValueError(f"HFCausalLM(model={model!r}): no directory by that name (relative paths are read from"
                             f" {Path.cwd()}). Give the directory that holds the model's config.json.")
        self.save_hyperparameters()
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(self.hparams.model)
        try:
            self.model = AutoModelForCausalLM.from_config(config, attn_implementation=self.hparams.attn_implementation)
        except ValueError:  # a family without this attention backend (Gemma-2, Bloom: eager only)
            self.model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")

    def _loss(self, batch: Any) -> Tensor:
        if isinstance(batch, dict):
            return self.model(**batch).loss
        inputs, targets = batch
        logits = self.model(input_ids=inputs).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))



def write_random_checkpoint(config_dir: str, out_dir: str, seed: int = 0) -> None:
    """A randomly initialized checkpoint of ``config_dir``'s model, written with save_pretrained (offline)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    model.save_pretrained(out_dir, safe_serialization=True)


if __name__ == "__main__":
    random_checkpoint_command(write_random_checkpoint)
