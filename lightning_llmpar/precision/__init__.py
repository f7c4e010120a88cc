"""Precision plugins for the device mesh: BF16, FP16 with a mesh-wide loss scaler, FP8 (torchao float8)."""

from lightning_llmpar.precision.plugins import (
    BF16Precision,
    FP8Precision,
    FP16Precision,
    MeshGradScaler,
    compute_dtype,
    mesh_precision,
)

__all__ = ["BF16Precision", "FP8Precision", "FP16Precision", "MeshGradScaler", "compute_dtype", "mesh_precision"]
