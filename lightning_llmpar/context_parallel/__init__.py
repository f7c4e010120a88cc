"""Context parallelism: each rank holds part of every sequence (ring or Ulysses attention over the cp axis)."""

from lightning_llmpar.context_parallel.apply_cp import ContextParallel, apply_context_parallel
from lightning_llmpar.context_parallel.attention import MODES

__all__ = ["MODES", "ContextParallel", "apply_context_parallel"]
