"""String names for common layouts, so `Trainer(strategy="llmpar_fsdp")` works once the package is imported."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_llmpar.strategies.llm_parallel import LLMParallelStrategy

__all__ = ["PRESETS", "register_strategies"]

# name -> (description, keyword arguments)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llmpar": ("Replicated data parallelism (ZeRO-0) on the llmpar mesh", {}),
    "llmpar_ddp": ("Replicated data parallelism (ZeRO-0): all-reduced gradients", {"zero_stage": 0}),
    "llmpar_zero1": ("ZeRO-1: optimizer state sharded over data parallel ranks", {"zero_stage": 1}),
    "llmpar_zero2": ("ZeRO-2: optimizer state and gradients sharded", {"zero_stage": 2}),
    "llmpar_fsdp": ("ZeRO-3 / FSDP2: parameters, gradients and optimizer state sharded", {"zero_stage": 3}),
    "llmpar_hsdp": (
        "Hybrid ZeRO-3: shard within a node, replicate across nodes",
        {"zero_stage": 3, "data_parallel_replicate": "num_nodes"},
    ),
    "llmpar_tp": ("Tensor parallelism over all devices of the run (with sequence parallelism)", {"tensor_parallel": "devices"}),
    "llmpar_tp2": ("Tensor parallelism of degree 2, data parallel over the rest", {"tensor_parallel": 2}),
    "llmpar_tp2_fsdp": ("Tensor parallelism of degree 2 x ZeRO-3 over the rest", {"tensor_parallel": 2, "zero_stage": 3}),
}


def register_strategies() -> None:
    for name, (description, kwargs) in PRESETS.items():
        if name in StrategyRegistry:
            continue
        if kwargs.get("tensor_parallel") == "devices":
            # Degree only known once devices are; Lightning gives parallel_devices before _configure_launcher.
            StrategyRegistry.register(name, _AllDevicesTP, description=description)
        else:
            StrategyRegistry.register(name, LLMParallelStrategy, description=description, **kwargs)


class _AllDevicesTP(LLMParallelStrategy):
    """Tensor parallelism across every process of the run."""

    def _degrees(self, world_size: int) -> dict[str, Any]:
        return {**super()._degrees(world_size), "tensor_parallel": world_size}
