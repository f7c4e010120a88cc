"""Selective activation checkpointing: per-block modes chosen by policy or memory budget, on torch.utils.checkpoint."""

from lightning_llmpar.activation_checkpointing.policy import ActivationCheckpointing, apply_activation_checkpointing

__all__ = ["ActivationCheckpointing", "apply_activation_checkpointing"]
