"""Lightning callbacks: throughput, MFU and memory; the pipeline schedule's timeline."""

from lightning_llmpar.callbacks.throughput import ThroughputAndMemory
from lightning_llmpar.callbacks.timeline import PipelineTimeline

__all__ = ["ThroughputAndMemory", "PipelineTimeline"]
