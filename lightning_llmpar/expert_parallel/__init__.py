"""Expert parallelism: MoE experts split over data-parallel ranks, tokens dispatched with all-to-all."""

from lightning_llmpar.expert_parallel.apply_ep import ExpertParallel, apply_expert_parallel, find_experts

__all__ = ["ExpertParallel", "apply_expert_parallel", "find_experts"]
