"""One validated description of how the world is split: degrees, mesh and the checks behind them."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelLayout", "ZERO_STAGES", "reuse_groups"]

T = TypeVar("T")

ZERO_STAGES = (0, 1, 2, 3)

# Mesh axes from outermost to innermost. Tensor parallel is innermost so its (chatty) ranks are
# neighbours on one node; pipeline is outermost because it only sends activations between stages. Context
# parallel sits next to dp_shard so FSDP can shard over the two flattened together ("dp_shard_cp").
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


# Process groups made once per world and reused: a process that fits more than once (a sweep, a notebook, fit after
# fit) would otherwise add new groups every time, and torch frees none of them (a root mesh keeps its groups alive).
# On gloo every group holds threads of its own: hundreds of fits in one process slowed to a crawl.
_GROUPS: dict[Hashable, tuple[Any, Any]] = {}


def reuse_groups(key: Hashable, build: Callable[[], T]) -> T:
    """``build()`` once per default process group and ``key``; every rank must ask for the same keys in order."""
    world = dist.distributed_c10d._get_default_group()
    cached = _GROUPS.get(key)
    if cached is None or cached[0] is not world:
        cached = _GROUPS[key] = (world, build())
    return cached[1]


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of every parallel axis, checked against each other and the world size.

    ``dp_replicate`` x ``dp_shard`` is the data-parallel degree. ZeRO stage 0 replicates parameters
    (``dp_shard`` is 1); stages 1-3 shard over ``dp_shard`` and replicate over ``dp_replicate``
    (hybrid sharding when both are above 1). ``cp`` ranks hold parts of the same sequences: they read the same
    batches, and FSDP shards parameters and averages gradients over ``dp_shard`` x ``cp``. ``ep`` ranks are
    consecutive data-parallel ranks (inside ``dp_shard``, or inside ``dp_replicate`` at ZeRO-0) that split every MoE
    layer's experts; expert weights are sharded or replicated over the remaining data-parallel ranks.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    zero_stage: int = 0
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "dp_replicate", "dp_shard", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout: `{name}` must be a positive integer, got {value!r}.")
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"`zero_stage` must be one of {ZERO_STAGES}, got {self.zero_stage!r}.")
        if self.zero_stage == 0 and self.dp_shard != 1:
            raise ValueError(
                f"zero_stage=0 replicates parameters, so there is nothing to shard over dp_shard={self.dp_shard}."
                " Use zero_stage>=1 for sharding, or set data_parallel_replicate=data_parallel."
            )
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) * tp({self.tp}) *"
                f" pp({self.pp})"
                f" = {product} != world_size({self.world_size}). Choose degrees whose product is the number of"
                " processes (devices x nodes), or leave `data_parallel` as 'auto'."
            )
        if self.ep > 1:
            self._check_expert_parallel()

    def _check_expert_parallel(self) -> None:
        # The expert-parallel group is the innermost data-parallel ranks: within dp_shard when parameters are
        # sharded (so the remaining ranks shard the experts), within dp_replicate at ZeRO-0 (dp_shard is 1).
        axis, size = ("dp_shard", self.dp_shard) if self.zero_stage else ("dp_replicate", self.dp_replicate)
        if size % self.ep:
            raise ValueError(
                f"expert_parallel({self.ep}) must divide the data-parallel ranks it is taken from: {axis}({size})"
                f" (data_parallel={self.dp}, data_parallel_replicate={self.dp_replicate}, zero_stage={self.zero_stage})."
                " Choose expert_parallel among the divisors of that number, or change the degrees."
            )

    @classmethod
    def from_degrees(
        cls,
        world_size: int,
        *,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        data_parallel: int | str = "auto",
        data_parallel_replicate: int | str = "auto",
        zero_stage: int = 0,
        context_parallel: int = 1,
        expert_parallel: int = 1,
    ) -> ParallelLayout:
        """Build a layout from the user-facing degrees, inferring 'auto' values from the world size."""
        pairs = (("tensor_parallel", tensor_parallel), ("pipeline_parallel", pipeline_parallel),
                 ("context_parallel", context_parallel), ("expert_parallel", expert_parallel))
        for name, value in pairs:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        model_parallel = tensor_parallel * pipeline_parallel * context_parallel
        if data_parallel == "auto":
            if world_size % model_parallel != 0:
                raise ValueError(
                    f"world_size({world_size}) is not divisible by tensor_parallel({tensor_parallel}) *"
                    f" pipeline_parallel({pipeline_parallel}) * context_parallel({context_parallel}) = {model_parallel}."
                    " Change the number of devices or the parallel degrees."
                )
            data_parallel = world_size // model_parallel
        if not isinstance(data_parallel, int) or data_parallel < 1:
            raise ValueError(f"`data_parallel` must be a positive integer or 'auto', got {data_parallel!r}.")
        if zero_stage == 0:
            replicate = data_parallel if data_parallel_replicate == "auto" else data_parallel_replicate
            if replicate != data_parallel:
                raise ValueError(
                    f"zero_stage=0 replicates parameters on every data-parallel rank, so data_parallel_replicate"
                    f"({data_parallel_replicate}) must equal data_parallel({data_parallel}) or be 'auto'."
                )
        else:
            replicate = 1 if data_parallel_replicate == "auto" else data_parallel_replicate
        if not isinstance(replicate, int) or replicate < 1 or data_parallel % replicate != 0:
            raise ValueError(
                f"data_parallel_replicate({data_parallel_replicate}) must be a positive divisor of"
                f" data_parallel({data_parallel}): each of the replicas shards over data_parallel / replicas ranks."
            )
        return cls(
            world_size=world_size,
            tp=tensor_parallel,
            pp=pipeline_parallel,
            dp_replicate=replicate,
            dp_shard=data_parallel // replicate,
            zero_stage=zero_stage,
            cp=context_parallel,
            ep=expert_parallel,
        )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def degrees(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}

    def __str__(self) -> str:
        return (
            f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x tp={self.tp} x pp={self.pp}"
            f" (zero_stage={self.zero_stage}, ep={self.ep}, world_size={self.world_size})"
        )

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The one mesh every technique slices, and its data-parallel axes flattened into one ('dp'; the batch
        sampler's ranks). ``dp_shard`` and ``cp`` are flattened too ('dp_shard_cp'), the axis FSDP shards over, and
        under tensor or pipeline parallelism the axes of different data ('dp_cp', 'pp_dp_cp': training.sync_groups)."""
        shape = tuple(self.degrees[axis] for axis in MESH_AXES)

        def build() -> tuple[DeviceMesh, DeviceMesh]:
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            if self.tp > 1 and self.dp_shard * self.cp > 1:
                # A gradient norm is partial over both axes a parameter is sharded on (FSDP's and tensor
                # parallelism's): with the two flattened, DTensor reduces it in one all-reduce instead of two.
                shard = ("dp_shard", "cp") if self.cp > 1 else ("dp_shard",)
                mesh[(*shard, "tp")]._flatten("_".join((*shard, "tp")))
            if self.tp > 1 or self.pp > 1:  # the ranks holding different data, for logged values and metrics
                mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
                if self.tp > 1 and self.pp > 1:
                    mesh["pp", "dp_replicate", "dp_shard", "cp"]._flatten("pp_dp_cp")
            if self.cp > 1 and self.pp > 1:  # evaluation's metrics: context-parallel ranks hold copies there
                mesh["pp", "dp_replicate", "dp_shard"]._flatten("pp_dp")
            return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")

        return reuse_groups(("mesh", device_type, shape), build)

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The (dp_replicate, shard) mesh FSDP runs on. Context-parallel ranks compute gradients of the same
        parameters from different tokens, so with cp > 1 the shard axis is 'dp_shard_cp' (as in torchtitan). It is
        joined to dp_replicate as a mesh of its own: torch deprecates slicing a flattened axis from the root mesh."""
        if self.cp == 1:
            return mesh["dp_replicate", "dp_shard"]
        return DeviceMesh._concatenate([mesh["dp_replicate"], mesh["dp_shard", "cp"]._flatten("dp_shard_cp")])

    def expert_meshes(self, mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
        """``mesh`` with the data-parallel axis that holds the expert-parallel ranks split in two (outer: the rest,
        innermost: 'ep'), and the (replicate, shard) mesh expert weights are data-parallel over."""
        groups = tuple(mesh.get_group(dim).group_name for dim in range(mesh.ndim))  # which mesh, by its groups
        return reuse_groups(("experts", groups, bool(self.zero_stage), self.ep), lambda: self._expert_meshes(mesh))

    def _expert_meshes(self, mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
        if self.zero_stage:
            experts = mesh._unflatten(MESH_AXES.index("dp_shard"), (self.dp_shard // self.ep, self.ep), ("edp_shard", "ep"))
            return experts, experts["dp_replicate", "edp_shard"]
        experts = mesh._unflatten(MESH_AXES.index("dp_replicate"), (self.dp_replicate // self.ep, self.ep),
                                  ("edp_replicate", "ep"))
        return experts, experts["edp_replicate", "dp_shard"]
