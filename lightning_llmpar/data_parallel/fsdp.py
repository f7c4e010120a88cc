"""Data parallelism with ZeRO stages 0-3 on FSDP2 (``fully_shard``), including hybrid sharding.

Stage -> FSDP2 setting:
- 0: parameters replicated, gradients all-reduced. FSDP2 on a (replicate=dp, shard=1) mesh, which is
  DDP's arithmetic and, unlike DDP, accepts the DTensor parameters tensor parallelism produces. (Pure data
  parallelism in full precision runs on DDP itself: data_parallel.replicate.)
- 1, 2: optimizer state and gradients sharded, parameters gathered once per step and kept through
  backward (``reshard_after_forward=False``). FSDP2 always reduce-scatters gradients into shards:
  that costs the same bytes as an all-reduce, so stage 1 runs as stage 2.
- 3: parameters sharded too and re-gathered for backward (``reshard_after_forward=True``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_llmpar.data_parallel.replicate import DDP
from lightning_llmpar.modeling.structure import BlockStack, has_forward

__all__ = ["apply_data_parallel", "no_gradient_sync", "shard_units"]


def apply_data_parallel(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    zero_stage: int,
    blocks: BlockStack | None,
    cpu_offload: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Wrap each block, then the root, with ``fully_shard`` over the 2-D (dp_replicate, dp_shard) mesh."""
    offload: OffloadPolicy = OffloadPolicy()
    if cpu_offload:
        # Pinned memory needs an accelerator; on a CPU-only host pinning fails outright.
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    kwargs = {
        "mesh": dp_mesh,
        "reshard_after_forward": zero_stage == 3,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload,
    }
    # Blocks first: each becomes its own all-gather / reduce-scatter unit, so communication for block
    # i+1 overlaps compute of block i. The root then owns what is left (embeddings, norm, head).
    if blocks is not None:
        # Parameters several blocks use (Zamba's shared attention) form one unit of their own, wrapped first: each
        # block's unit then leaves them to it (one parameter in two units is refused by FSDP2); it is gathered for
        # every call and its gradient accumulated over them.
        shared = [unit for module in _shared_modules(blocks) for unit in shard_units(module)]
        if shared:
            fully_shard(shared if len(shared) > 1 else shared[0], **kwargs)
        # A block the stack holds twice is one unit; one that is wholly shared is a unit already.
        seen = {id(unit): unit for block in blocks.modules() for unit in shard_units(block)}
        units = [unit for unit in seen.values() if not isinstance(unit, FSDPModule)]
        # ZeRO 0-2 keep parameters gathered from forward to the end of backward, so larger units cost no memory
        # beyond one bucket's gradient: consecutive blocks share a unit of up to DDP's 25 MiB bucket, and a
        # step makes a few large collectives instead of one small one per block. ZeRO-3 keeps one unit per block
        # so that only two are gathered at a time.
        groups = _buckets(units, BUCKET_BYTES) if zero_stage < 3 else [[unit] for unit in units]
        for group in groups:
            fully_shard(group if len(group) > 1 else group[0], **kwargs)
        inner = _owner_of_the_rest(model)
        if inner is not None:  # its inputs left as they were: the root's cast of the batch is the one that ran
            fully_shard(inner, **{**kwargs, "mp_policy": replace(kwargs["mp_policy"], cast_forward_inputs=False)})
    fully_shard(model, **kwargs)
    return model


def _owner_of_the_rest(model: nn.Module) -> nn.Module | None:
    """The one child of ``model`` that holds every parameter no unit holds yet (a LightningModule's ``self.model``:
    its embeddings, final norm and head), made a unit of its own. A unit gathers its parameters around its own
    calls, so ``module.model(x)`` or ``module.model.generate(...)`` called outside a step (after fit, in a callback)
    finds them gathered; as the root's, they were gathered only around the root's forward, and such a call failed
    under ZeRO-1-3 (an embedding of DTensor shards). None when the model holds some itself or several children do."""
    managed = {id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    rest = [name for name, p in model.named_parameters() if id(p) not in managed]
    owners = {name.split(".", 1)[0] for name in rest}
    if len(owners) != 1 or any("." not in name for name in rest):
        return None
    child = model.get_submodule(owners.pop())
    return None if isinstance(child, FSDPModule) or not has_forward(child) else child


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb; 50 and 100 MiB measured slower (benchmarks/README.md)


def _local_bytes(module: nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in module.parameters())


def _buckets(units: list[nn.Module], cap: int) -> list[list[nn.Module]]:
    """Consecutive units grouped while their parameters' local bytes stay within ``cap`` (a larger unit alone)."""
    groups: list[list[nn.Module]] = []
    size = 0
    for unit in units:
        n = _local_bytes(unit)
        if groups and size + n <= cap:
            groups[-1].append(unit)
            size += n
        else:
            groups.append([unit])
            size = n
    return groups


def _shared_modules(blocks: BlockStack) -> list[nn.Module]:
    """The outermost modules, in any block, whose parameters all belong to more than one block (one module object
    several blocks hold, or per-block modules tied to the same parameters, as Zamba's shared attention is)."""
    holders: dict[int, set[int]] = {}
    for i, block in enumerate(blocks.modules()):
        for param in block.parameters():
            holders.setdefault(id(param), set()).add(i)
    shared = {key for key, held in holders.items() if len(held) > 1}
    found: dict[int, nn.Module] = {}  # by id: one module object several blocks hold is found once

    def visit(module: nn.Module) -> None:
        params = [id(p) for p in module.parameters()]
        if params and all(key in shared for key in params):
            found[id(module)] = module
            return
        for child in module.children():
            visit(child)

    if shared:
        for block in blocks.modules():
            visit(block)
    return list(found.values())


def shard_units(module: nn.Module) -> list[nn.Module]:
    """FSDP2 units for ``module``: itself if it has a forward (FSDP2's hooks run around calls), otherwise its
    parameter-holding children, recursively (a block stored as ``ModuleList([norm, block, residual])``)."""
    if has_forward(module):
        return [module] if any(True for _ in module.parameters()) else []
    return [unit for child in module.children() for unit in shard_units(child)]


@contextmanager
def no_gradient_sync(roots: list[nn.Module]) -> Iterator[None]:
    """Accumulate gradients locally (no reduce-scatter/all-reduce) for the non-final micro-batches; ``roots`` are
    FSDP2's (every unit under them) or DDP's (see data_parallel.replicate)."""
    units = [m for root in roots for m in root.modules() if isinstance(m, FSDPModule)]
    replicas = [root for root in roots if isinstance(root, DDP)]
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    for replica in replicas:
        replica.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)
        for replica in replicas:
            replica.set_requires_gradient_sync(True)
