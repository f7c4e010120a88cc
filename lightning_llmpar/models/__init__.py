"""Example models: a small Llama-style GPT and its LightningModule."""

from lightning_llmpar.models.gpt import GPT, GPTConfig
from lightning_llmpar.models.hf import HFCausalLM
from lightning_llmpar.models.lit_gpt import GPTModule

__all__ = ["GPT", "GPTConfig", "GPTModule", "HFCausalLM"]
