"""The layout planner: predicts per-rank memory and step time of every layout and writes the best as a config."""

from lightning_llmpar.planner.candidate import Candidate
from lightning_llmpar.planner.cluster import CLUSTERS, Cluster, cluster_from
from lightning_llmpar.planner.memory import MemoryEstimate, predict_memory
from lightning_llmpar.planner.search import Plan, PlannedLayout, plan
from lightning_llmpar.planner.spec import ModelSpec, llama_spec, model_spec
from lightning_llmpar.planner.speed import TimeEstimate, predict_step_time

__all__ = [
    "CLUSTERS",
    "Candidate",
    "Cluster",
    "MemoryEstimate",
    "ModelSpec",
    "Plan",
    "cluster_from",
    "llama_spec",
    "PlannedLayout",
    "TimeEstimate",
    "model_spec",
    "plan",
    "predict_memory",
    "predict_step_time",
]
