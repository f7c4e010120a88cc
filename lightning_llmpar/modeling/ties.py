"""Tied weights (an input embedding shared with the LM head, shared blocks) stay tied under every layout.

- Tensor parallelism shards a tied weight once and hands the same parameter to every module using it;
  the plan must split it the same way everywhere (embedding rows and LM-head output features are both
  dim 0 of the weight), which `check_tied_styles` verifies before anything is split.
- Pipeline parallelism gives every stage that uses a tied weight its own copy, as Megatron does (and every rank a
  copy of the modules before the stack when the blocks read what they compute, see pipeline.check): the
  copies start equal (`TiedCopies.make_equal`) and, after each step, their gradients are summed over the
  stages holding them (`TiedCopies.sum_grads`), so every copy takes the same update. The gradient norm
  counts the weight once (`TiedCopies.duplicates`), and checkpoints store the optimizer state of every
  copy under the name one process gives the weight (`TiedCopies.aliases`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_llmpar.layout import reuse_groups

__all__ = ["TiedWeight", "TiedCopies", "find_tied_weights", "retie", "split_copies"]


@dataclass(frozen=True)
class TiedWeight:
    """One parameter reachable under several names; ``names[0]`` is the name one process reports."""

    names: tuple[str, ...]

    @property
    def canonical(self) -> str:
        return self.names[0]


def find_tied_weights(model: nn.Module) -> list[TiedWeight]:
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [TiedWeight(tuple(names)) for names in by_id.values() if len(names) > 1]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return (model.get_submodule(module_name) if module_name else model), attr


def retie(model: nn.Module, tied: Sequence[TiedWeight]) -> None:
    """Point every name of each tied weight at the parameter its first (reachable) name holds now, or the first
    sharded one (a parent's alias of a layer's parameter is not sharded with the layer: BERT's prediction head
    keeps its decoder's bias).

    Sharding replaces a module's parameter by a new one; a weight used by two modules would otherwise
    become two independent parameters.
    """
    for weight in tied:
        reachable = [n for n in weight.names if _resolves(model, n)]
        if len(reachable) < 2:
            continue
        source = next((n for n in reachable if isinstance(model.get_parameter(n), DTensor)), reachable[0])
        owner, attr = _owner(model, source)
        param = getattr(owner, attr)
        for name in reachable:
            module, attr = _owner(model, name)
            if getattr(module, attr) is not param:
                module.register_parameter(attr, param)


def _resolves(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


def split_copies(model: nn.Module, tied: Sequence[TiedWeight], stage_of: Callable[[str], int], local_stages: Sequence[int]) -> None:
    """Give each local pipeline stage its own copy of the tied weights it uses (before any sharding).

    A weight used by two stages of this rank would otherwise be one parameter inside two FSDP units.
    """
    for weight in tied:
        seen: dict[int, nn.Parameter] = {}
        for name in weight.names:
            stage = stage_of(name)
            if stage not in local_stages or not _resolves(model, name):
                continue
            module, attr = _owner(model, name)
            param = getattr(module, attr)
            if stage in seen:
                module.register_parameter(attr, seen[stage])
            elif seen:
                copy = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
                module.register_parameter(attr, copy)
                seen[stage] = copy
            else:
                seen[stage] = param


@dataclass
class _Group:
    weight: TiedWeight
    local: list[str]  # one name per local copy
    group: dist.ProcessGroup | None  # pipeline ranks holding copies, when more than this one
    src: int  # group rank holding the first stage's copy (the one that counts)
    primary: str | None  # the local name of the counted copy, if this rank holds it


class TiedCopies:
    """The tied weights' copies on this pipeline rank, and the stages they are shared with."""

    def __init__(self, model: nn.Module, groups: list[_Group]) -> None:
        self.model, self.groups = model, groups

    @classmethod
    def build(
        cls,
        model: nn.Module,
        tied: Sequence[TiedWeight],
        stage_of: Callable[[str], int],
        rank_of_stage: Callable[[int], int],
        mesh: DeviceMesh,
        replicas: Sequence[str] = (),
    ) -> TiedCopies:
        """Every rank calls this with the same arguments (process groups are created collectively). ``replicas``:
        parameters every pipeline rank holds (modules before the stack that every stage runs), one copy per rank;
        the copy on the first rank counts."""
        pp_rank = mesh.get_local_rank("pp")
        everywhere = mesh.get_group("pp")
        groups = [_Group(TiedWeight((n,)), [n], everywhere, 0, n if pp_rank == 0 else None) for n in replicas]
        for weight in tied:
            if set(weight.names) & set(replicas):
                # An embedding tied to the head: the last rank's head is its copy of the embedding itself (one
                # parameter there), so the sum over the replicas takes the head's gradient in.
                continue
            stages = sorted({stage_of(n) for n in weight.names})
            if len(stages) < 2:
                continue
            holders = sorted({rank_of_stage(s) for s in stages})
            first_rank = rank_of_stage(stages[0])
            group = _pp_subgroup(mesh, holders) if len(holders) > 1 else None
            if pp_rank not in holders:
                continue
            local: list[str] = []
            for stage in stages:
                if rank_of_stage(stage) == pp_rank:
                    local.append(next(n for n in weight.names if stage_of(n) == stage))
            primary = local[0] if pp_rank == first_rank else None
            groups.append(_Group(weight, local, group, holders.index(first_rank), primary))
        return cls(model, groups)

    def _params(self, group: _Group) -> list[nn.Parameter]:
        return [self.model.get_parameter(n) for n in group.local]

    @torch.no_grad()
    def make_equal(self) -> None:
        """Copy the first stage's values into every other copy (their initializations may differ)."""
        for g in self.groups:
            params = self._params(g)
            source = _local(params[0])
            if g.group is not None:
                dist.broadcast(source, group=g.group, group_src=g.src)
            for p in params[1:]:
                _local(p).copy_(source)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Give every copy the sum of all copies' gradients (what one shared parameter would receive)."""
        for g in self.groups:
            params = [p for p in self._params(g) if p.requires_grad]
            if not params:
                continue
            for p in params:
                if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    # e.g. a vocab-parallel embedding's gradient comes out partial: settle it first.
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            grads = [_local(p.grad) if p.grad is not None else None for p in params]
            total = torch.zeros_like(_local(params[0]))
            for grad in grads:
                if grad is not None:
                    total += grad
            if g.group is not None:
                dist.all_reduce(total, group=g.group)
            for p, grad in zip(params, grads):
                if grad is not None:
                    grad.copy_(total)
                else:
                    p.grad = _like(p, total.clone())

    def duplicates(self) -> set[int]:
        """ids of the copies the gradient norm must skip: all but the first stage's."""
        skip: set[int] = set()
        for g in self.groups:
            for name in g.local:
                if name != g.primary:
                    skip.add(id(self.model.get_parameter(name)))
        return skip

    def counted_shared(self) -> set[int]:
        """ids of the counted copies of weights several stages share (an embedding tied to the last stage's head),
        not of the modules every stage runs."""
        return {id(self.model.get_parameter(g.primary)) for g in self.groups
                if g.primary is not None and len(g.weight.names) > 1}

    def aliases(self) -> dict[str, str]:
        """Local copy name -> the name one process gives the weight (for optimizer state in checkpoints)."""
        return {name: g.weight.canonical for g in self.groups for name in g.local if name != g.weight.canonical}


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(param: Tensor, local: Tensor) -> Tensor:
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
    return local


def _pp_subgroup(mesh: DeviceMesh, pp_ranks: list[int]) -> dist.ProcessGroup | None:
    """The group of ``pp_ranks`` along the pipeline axis that shares this rank's other coordinates
    (None on ranks outside ``pp_ranks``)."""
    if len(pp_ranks) == mesh.size(0):
        return mesh.get_group("pp")
    others = mesh.mesh[pp_ranks].reshape(len(pp_ranks), -1)  # mesh.mesh: global ranks, pp axis first
    columns = [[int(r) for r in others[:, column]] for column in range(others.shape[1])]
    # Every rank creates every group, in the same order.
    groups = reuse_groups(("pp_subgroups", *map(tuple, columns)), lambda: [dist.new_group(m) for m in columns])
    return next((g for g, members in zip(groups, columns) if dist.get_rank() in members), None)
