"""Example models: a small Llama-style GPT, and LightningModules that fine-tune Hugging Face and LitGPT models."""

from lightning_llmpar.models.gpt import GPT, GPTConfig
from lightning_llmpar.models.hf import HFCausalLM
from lightning_llmpar.models.lit_gpt import GPTModule
from lightning_llmpar.models.litgpt import LitGPTModule

__all__ = ["GPT", "GPTConfig", "GPTModule", "HFCausalLM", "LitGPTModule"]
