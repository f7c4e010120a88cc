"""Checkpoints: distributed (DCP) folders written atomically, consolidated export, Hugging Face and LitGPT weights
read per rank and written back."""

from lightning_llmpar.checkpointing.dcp import export_consolidated
from lightning_llmpar.checkpointing.hf_checkpoint import HFCheckpointExport, load_hf_checkpoint, save_hf_checkpoint
from lightning_llmpar.checkpointing.litgpt_checkpoint import load_litgpt_checkpoint

__all__ = ["HFCheckpointExport", "export_consolidated", "load_hf_checkpoint", "load_litgpt_checkpoint", "save_hf_checkpoint"]
