"""lightning_llmpar: LLM-style parallelism (tensor, sequence, pipeline, ZeRO/FSDP, hybrid) for any LightningModule.

Everything a user names in code or in a LightningCLI YAML config is importable from here.
"""

from lightning_llmpar.activation_checkpointing import ActivationCheckpointing
from lightning_llmpar.callbacks import PipelineTimeline, ThroughputAndMemory
from lightning_llmpar.checkpointing import (
    HFCheckpointExport,
    export_consolidated,
    load_hf_checkpoint,
    load_litgpt_checkpoint,
    save_hf_checkpoint,
)
from lightning_llmpar.fault_tolerance import (
    DataPosition,
    FaultTolerantCheckpoint,
    ResumableDataLoader,
    ResumableDistributedSampler,
    StepGuard,
)
from lightning_llmpar.layout import ParallelLayout
from lightning_llmpar.parallelize import ParallelConfig, parallelize
from lightning_llmpar.planner import plan
from lightning_llmpar.precision import BF16Precision, FP8Precision, FP16Precision
from lightning_llmpar.strategies.llm_parallel import LLMParallelStrategy
from lightning_llmpar.strategies.registry import PRESETS, register_strategies
from lightning_llmpar.training.clip import grad_norm
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
    "plan",
    "export_consolidated",
    "save_hf_checkpoint",
    "load_hf_checkpoint",
    "load_litgpt_checkpoint",
    "HFCheckpointExport",
    "FaultTolerantCheckpoint",
    "DataPosition",
    "StepGuard",
    "ResumableDistributedSampler",
    "ResumableDataLoader",
    "ThroughputAndMemory",
    "PipelineTimeline",
    "grad_norm",
    "verify_parity",
    "ParityReport",
    "PRESETS",
    "__version__",
]

register_strategies()
