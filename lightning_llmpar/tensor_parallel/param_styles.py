"""DTensor styles for parameters that are not a projection's: whole weights applied to sharded activations
(norms under sequence parallelism, per-head q/k norms, an activation's parameters on an MLP's split features),
a norm over all heads' features split with them, and an attention's own per-head values."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_llmpar.tensor_parallel.styles import _distribute, _local_params_in_forward, _to_dtensor

__all__ = ["OwnPerHead", "OwnShared", "ReplicatedOnShards", "ShardedNorm"]


class ReplicatedOnShards(ParallelStyle):
    """Whole (replicated) parameters applied to activations sharded along the dim ``from_end`` places from
    the end: a norm on sequence-parallel tokens (``from_end=2``), a per-head q/k norm on this rank's heads
    (``from_end=2`` of ``(batch, seq, heads, head_dim)``), an activation with parameters on this rank's MLP
    features (``from_end=1``, ``widths``: the local widths that sharded dim may have). DTensor sums the weight
    gradient over ranks."""

    def __init__(self, from_end: int = 2, widths: frozenset[int] | None = None) -> None:
        super().__init__()
        self.from_end, self.widths = from_end, widths

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, _distribute(param, mesh, Replicate()))

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if self.widths is not None and not isinstance(x, DTensor) and x.shape[-self.from_end] not in self.widths:
            # Called on something else than this rank's features (the MLP's whole input): its parameters would
            # get a wrong gradient, so stop before the first step completes.
            raise ValueError(
                f"{type(module).__name__} holds parameters inside a tensor-parallel MLP and was called on"
                f" {x.shape[-self.from_end]} features, not on this rank's share of the MLP's width"
                f" ({sorted(self.widths)}). Give it a style in tp_plan, or train this model without tensor parallelism."
            )
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Shard(x.dim() - self.from_end),), run_check=False)
        return (x, *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            lambda mod, inputs, mesh: self._prepare_input(mod, inputs, mesh),
            lambda mod, outputs, mesh: outputs.to_local() if isinstance(outputs, DTensor) else outputs,
        )


def _features(tensor: Any, first: Any, mesh: DeviceMesh, gather: bool) -> Any:
    if isinstance(tensor, Tensor) and not isinstance(tensor, DTensor) and tensor.shape == first.shape:
        return _to_dtensor(tensor, mesh, Shard(-1), Replicate() if gather else Shard(-1))
    return tensor


def _local_features(out: Any) -> Any:
    if not isinstance(out, DTensor):
        return out
    return (out if out.placements == (Shard(out.dim() - 1),) else out.redistribute(placements=(Shard(-1),))).to_local()


class ShardedNorm(ParallelStyle):
    """A norm over the full width of a column-split projection (OLMo-2's q/k norms; a Mamba-2 gated norm whose
    head group spans ranks): its weight is split like the features and the statistic is reduced over ranks by
    DTensor. Its inputs of the features' shape (a gated norm's gate too) are this rank's features. ``gather``: the
    norm runs on the gathered features (its code reshapes them into groups that DTensor cannot keep split)."""

    def __init__(self, gather: bool = False) -> None:
        super().__init__()
        self.gather = gather

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, _distribute(param, mesh, Shard(0)))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.gather:  # its weight too, so that backward keeps every gradient whole until the output
            names = [n for n, _ in module.named_parameters(recurse=False)]
            _local_params_in_forward(module, names, lambda _n, p: p.redistribute(placements=(Replicate(),)))
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            lambda mod, inputs, mesh: tuple(_features(x, inputs[0], mesh, self.gather) for x in inputs),
            lambda mod, outputs, mesh: _local_features(outputs),
        )


class OwnPerHead(ParallelStyle):
    """Parameters an attention module holds itself with one value per query head (GPT-OSS's sinks) or per key/value
    head (Doge's A), split by heads like its projections: each rank's code sees its heads' values."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            module.register_parameter(name, _distribute(getattr(module, name), device_mesh, Shard(0)))
        _local_params_in_forward(module, list(self.names))
        return module


class OwnShared(ParallelStyle):
    """Parameters an attention module holds itself that all its heads use (differential attention's λ vectors), or
    that it returns for the block to add to the residual stream (GPT-NeoX-Japanese's ``dense_bias``): whole on every
    rank. ``summed``: each rank's gradient (from its heads, or its tokens under sequence parallelism) is a part,
    summed over the ranks; else every rank computes the whole gradient alike."""

    def __init__(self, names: tuple[str, ...], summed: bool = True) -> None:
        super().__init__()
        self.names, self.summed = names, summed

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            module.register_parameter(name, _distribute(getattr(module, name), device_mesh, Replicate()))
        grads = (Partial(),) if self.summed else (Replicate(),)
        _local_params_in_forward(module, list(self.names), lambda _n, p: p.to_local(grad_placements=grads))
        return module

