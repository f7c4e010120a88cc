"""Gradient compression on the data-parallel axis: compressors (methods) and the FSDP2/DDP hooks that run them."""

from lightning_llmpar.data_parallel.compression.hooks import GradientCompression, apply_gradient_compression
from lightning_llmpar.data_parallel.compression.methods import CompressionConfig

__all__ = ["CompressionConfig", "GradientCompression", "apply_gradient_compression"]
