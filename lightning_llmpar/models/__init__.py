"""Example models: a small Llama-style GPT, and LightningModules that fine-tune Hugging Face and LitGPT models."""

from lightning_llmpar.models.gpt import GPT, GPTConfig
from lightning_llmpar.models.gpt_module import GPTModule
from lightning_llmpar.models.hf_causal_lm import HFCausalLM
from lightning_llmpar.models.litgpt_module import LitGPTModule

__all__ = ["GPT", "GPTConfig", "GPTModule", "HFCausalLM", "LitGPTModule"]
