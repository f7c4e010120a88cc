"""Surviving failures: atomic step checkpoints that resume, bad-step guards, a sampler that resumes mid-epoch."""

from lightning_llmpar.fault_tolerance.callbacks import FaultTolerantCheckpoint, StepGuard
from lightning_llmpar.fault_tolerance.position import DataPosition
from lightning_llmpar.fault_tolerance.sampler import ResumableDataLoader, ResumableDistributedSampler

__all__ = ["DataPosition", "FaultTolerantCheckpoint", "StepGuard", "ResumableDataLoader", "ResumableDistributedSampler"]
