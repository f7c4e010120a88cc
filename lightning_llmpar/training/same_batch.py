"""Every rank of one model replica must train on the same batch: its tensor-, context- and pipeline-parallel
ranks compute one step together, and only data-parallel ranks read batches of their own.

Lightning gives each process a batch of its own. With its distributed sampler that follows the strategy's
``distributed_sampler_kwargs`` (the data-parallel rank), but a dataset that shards itself by the global rank (an
``IterableDataset`` split by ``torch.distributed.get_rank()``, a stream per process) hands tensor-parallel ranks
different batches, and the step then computes from a mixture without any error: each rank's shard of every matmul
saw other tokens. The first training batches are compared over each of those axes (a few numbers per batch, one
all-gather per axis and one all-reduce), and a difference stops every rank with the ranks and the fix named.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_llmpar.training.batches import batch_tensors

__all__ = ["SameBatchCheck"]


def _fingerprint(batch: Any, device: torch.device) -> Tensor:
    """Shapes and values, summed plainly and by position (a reordering changes the second sum)."""
    out = torch.zeros(4, dtype=torch.float64, device=device)
    for t in batch_tensors(batch):
        flat = t.detach().reshape(-1).to(device=device, dtype=torch.float64)
        place = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=device).remainder_(8191).add_(1)
        out += torch.stack([torch.tensor(float(t.dim()), dtype=torch.float64, device=device),
                            torch.tensor(float(flat.numel()), dtype=torch.float64, device=device),
                            flat.sum(), (flat * place).sum()])
    return out


class SameBatchCheck:
    """Compares the first ``looks`` training batches over ``groups`` (axis name -> process group)."""

    def __init__(self, groups: dict[str, Any], device: torch.device, data_rank: dict[str, int], looks: int = 8) -> None:
        self.groups, self.device, self.data_rank, self.looks, self.seen = groups, device, data_rank, looks, 0

    def see(self, batch: Any) -> None:
        if self.seen >= self.looks or not self.groups:
            return
        self.seen += 1
        mine = _fingerprint(batch, self.device)
        differing: tuple[str, list[int]] | None = None
        for axis, group in self.groups.items():
            gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, mine, group=group)
            if differing is None and any(not torch.equal(g, gathered[0]) for g in gathered):
                differing = (axis, dist.get_process_group_ranks(group))
        # Every rank stops together: a difference in one replica would leave the others waiting in the next step.
        flag = torch.tensor([float(differing is not None)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            where = (f"the {differing[0]}-parallel ranks {differing[1]}" if differing is not None
                     else "the ranks of another model replica")
            raise ValueError(
                f"LLMParallelStrategy: {where} received different training batches (batch {self.seen - 1} of the"
                " run). Every tensor-, context- and pipeline-parallel rank of a replica must read the same batch,"
                " and only data-parallel ranks their own: shard the data by the data-parallel rank and size,"
                f" trainer.strategy.distributed_sampler_kwargs ({self.data_rank} on this rank), not by the global rank or"
                " world size (an IterableDataset split by torch.distributed.get_rank() does the latter), and draw"
                " random masking or augmentation from a generator seeded alike on those ranks (seed_everything(workers="
                "True) seeds loader workers by global rank)."
            )
