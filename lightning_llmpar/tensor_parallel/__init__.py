"""Tensor parallelism (Megatron column/row splits on DTensor) for models we did not write."""

from lightning_llmpar.modeling.packing import Packing
from lightning_llmpar.tensor_parallel.apply_tp import apply_tensor_parallel
from lightning_llmpar.tensor_parallel.families import HEAD_COUNT_ATTRS
from lightning_llmpar.tensor_parallel.plan import TP_STYLES, TPPlan, infer_tp_plan

__all__ = ["TP_STYLES", "TPPlan", "Packing", "infer_tp_plan", "apply_tensor_parallel", "HEAD_COUNT_ATTRS"]
