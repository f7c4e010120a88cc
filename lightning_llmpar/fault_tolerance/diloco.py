"""Low-bandwidth data parallelism between replica groups: DiLoCo on torchft.

Each replica group takes ``every`` optimizer steps on its own (the inner optimizer: the one the LightningModule
configures, over the group's own data-parallel ranks as usual), then the groups average their pseudo-gradients
(the weights at the last sync minus the weights now) and an outer optimizer (SGD with Nesterov momentum, as in
the DiLoCo paper) steps from the last synced weights. The groups exchange one model's worth of bytes every
``every`` steps instead of every step. torchft's ``DiLoCo`` does the work: its quorum runs once per sync, and a
step whose sync fails returns every group to the last synced weights.

With ``every=1``, an outer learning rate of 1 and no outer momentum, a linear inner optimizer (SGD, with or
without momentum) steps exactly as synchronous data parallelism over all groups would: the average of the
groups' updates is the update of their averaged gradients. Adam is not linear in its gradient, so there the
two differ even at ``every=1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torchft import Manager
    from torchft.local_sgd import DiLoCo

__all__ = [
    "DATA_PARALLEL_SYNC", "OUTER_STATE", "DiLoCoConfig", "check_data_parallel_sync", "keep_outer_settings",
    "outer_optimizer", "start_diloco",
]

DATA_PARALLEL_SYNC = ("every_step", "diloco")
OUTER_STATE = "llmpar_diloco_outer"  # a checkpoint's meta: its outer optimizer state saved (True), none yet (False)
DEFAULT_EVERY = 50


@dataclass(frozen=True)
class DiLoCoConfig:
    every: int = DEFAULT_EVERY  # inner steps between syncs (the paper's H)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov momentum where > 0


def check_data_parallel_sync(a: dict[str, Any]) -> DiLoCoConfig | None:
    """Check ``data_parallel_sync`` and the ``diloco_*`` arguments of the strategy's keyword arguments ``a``."""
    sync, every = a.get("data_parallel_sync", "every_step"), a.get("diloco_every")
    lr, momentum = a.get("diloco_outer_lr", 0.7), a.get("diloco_outer_momentum", 0.9)
    if sync not in DATA_PARALLEL_SYNC:
        raise ValueError(f"`data_parallel_sync` must be one of {DATA_PARALLEL_SYNC}, got {sync!r}.")
    if sync == "every_step":
        defaults = {"diloco_every": None, "diloco_outer_lr": 0.7, "diloco_outer_momentum": 0.9}  # the strategy's
        given = [f"{k}={a[k]!r}" for k, default in defaults.items() if a.get(k, default) != default]
        if given:
            raise ValueError(
                f"{', '.join(given)} given but data_parallel_sync='every_step' syncs every step and has no outer"
                " optimizer; set data_parallel_sync='diloco' to use them, or leave them out."
            )
        return None
    if a.get("fault_tolerance") != "torchft":
        raise ValueError(
            "data_parallel_sync='diloco' syncs replica groups, which fault_tolerance='torchft' provides (each group"
            f" its own job, see docs/fault-tolerance.md); got fault_tolerance={a.get('fault_tolerance')!r}."
        )
    every = DEFAULT_EVERY if every is None else every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"`diloco_every` must be a positive integer (inner steps between syncs), got {every!r}.")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 or lr == float("inf"):
        raise ValueError(f"`diloco_outer_lr` must be a positive number, got {lr!r}.")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"`diloco_outer_momentum` must be in [0, 1), got {momentum!r}.")
    return DiLoCoConfig(every, float(lr), float(momentum))


def outer_optimizer(model: nn.Module, config: DiLoCoConfig) -> torch.optim.SGD:
    """The outer optimizer, made at set-up: checkpoints hold its momentum (from the first sync on), and a resumed run
    loads it before the first step starts DiLoCo."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=config.outer_lr, momentum=config.outer_momentum,
                           nesterov=config.outer_momentum > 0)


def keep_outer_settings(outer: torch.optim.Optimizer) -> None:
    """After a checkpoint's state was loaded into ``outer``: its learning rate and momentum are the strategy's
    (``diloco_outer_lr``, ``diloco_outer_momentum``), not the ones saved; only the momentum buffers carry over."""
    for group in outer.param_groups:
        group.update({k: outer.defaults[k] for k in ("lr", "momentum", "nesterov")})


def start_diloco(manager: Manager, model: nn.Module, inner: torch.optim.Optimizer, outer: torch.optim.Optimizer,
                 config: DiLoCoConfig) -> DiLoCo:
    """torchft's DiLoCo over the whole model as one fragment, its hooks on ``inner``: entered, ready to train."""
    from torchft.local_sgd import DiLoCo, extract_local_tensor

    # One quorum before the first inner step, with torchft's step-0 weight sync turned off (ReplicaGroups): a
    # group fetching another's state there races the other's next steps. The groups must start from the same
    # weights instead (one seed, or one checkpoint), which an average of two checksums checks here.
    manager.start_quorum()
    manager.wait_quorum()  # a quorum with running groups gives their step: refused before any collective, which
    if manager.current_step() != 0:  # would not match theirs (their sync's all-reduce: a native abort in gloo)
        _refuse_restart(manager.current_step())
    with torch.no_grad():
        shards = [extract_local_tensor(p).double() for p in model.parameters()]
        mine = torch.stack([sum(t.sum() for t in shards), sum(t.square().sum() for t in shards)])
        mean = mine.clone()
        manager.allreduce(mean).wait()
    if not manager.should_commit() or manager.current_step() != 1:
        _refuse_restart(manager.current_step())
    if not torch.allclose(mean, mine, rtol=1e-9, atol=0):
        raise ValueError(
            f"The replica groups start DiLoCo from different weights (this group's sum and sum of squares"
            f" {mine.tolist()}, the groups' mean {mean.tolist()}): give every group the same seed (seed_everything)."
            " Resumed, every group needs a checkpoint of one sync step: groups part between syncs, so a checkpoint"
            " saved between two (every_n_train_steps not a multiple of diloco_every, a preemption's) or groups that"
            " stopped at different steps hold different weights; resume every group from the same step's, or copy"
            " one group's to all."
        )
    # The backup of the last synced weights stays in CPU memory (torchft's default); pinned only beside a GPU.
    diloco = DiLoCo(manager, [model], inner, outer, sync_every=config.every, backup_device=torch.device("cpu"),
                    pin_memory=torch.cuda.is_available())
    return diloco.__enter__()


def _refuse_restart(step: int) -> None:
    raise RuntimeError(
        f"This replica group could not join the DiLoCo replica groups at their first sync (their step is {step}): a"
        " group restarted into a running DiLoCo job is not supported (it would have to join the others' next sync"
        " halfway). Restart every group from the last checkpoint (FaultTolerantCheckpoint), or use"
        " data_parallel_sync='every_step', where a restarted group heals."
    )
