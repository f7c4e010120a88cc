"""lightning_llmpar: LLM-style parallelism (tensor, sequence, ZeRO/FSDP, hybrid) for any LightningModule."""

from lightning_llmpar.activation_checkpoint import ActivationCheckpointing
from lightning_llmpar.checkpoint import export_consolidated
from lightning_llmpar.hf_checkpoint import HFCheckpointExport, load_hf_checkpoint, save_hf_checkpoint
from lightning_llmpar.layout import ParallelLayout
from lightning_llmpar.parallelize import ParallelConfig, parallelize
from lightning_llmpar.precision import BF16Precision, FP8Precision, FP16Precision
from lightning_llmpar.registry import PRESETS, register_strategies
from lightning_llmpar.strategy import LLMParallelStrategy
from lightning_llmpar.verify import ParityReport, verify_parity

__version__ = "0.1.0"

__all__ = [
    "LLMParallelStrategy",
    "ActivationCheckpointing",
    "BF16Precision",
    "FP16Precision",
    "FP8Precision",
    "ParallelLayout",
    "ParallelConfig",
    "parallelize",
    "export_consolidated",
    "save_hf_checkpoint",
    "load_hf_checkpoint",
    "HFCheckpointExport",
    "verify_parity",
    "ParityReport",
    "PRESETS",
    "__version__",
]

register_strategies()
