"""Replica groups that survive one another: torchft's per-step quorum over whole data-parallel replicas.

Each replica group is its own job (its own torchrun or ``llmpar fit``, its own process group): inside it the
strategy shards and syncs as without fault tolerance. Between groups, torchft's ``Manager`` asks the lighthouse
for a quorum every step, averages gradients over the live groups only (a reconfigurable gloo process group that
pairs rank ``r`` of every group, so ZeRO shards meet their counterparts), and lets the optimizer step only when
the quorum commits. A group that dies is dropped at the next quorum; a restarted one receives weights, optimizer
and scheduler state and the step from a live peer (torchft's checkpoint transport) before it steps again.

Data: group ``g`` of ``G`` reads the shard ``g * dp + dp_rank`` of ``G * dp`` (as one job with ``G * dp``
data-parallel ranks would); a step that does not commit discards its batch, and a restarted group begins its
shard of the epoch again (see docs/fault-tolerance.md).
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.tensor import DTensor

from lightning_llmpar.fault_tolerance.diloco import DiLoCoConfig, outer_optimizer, start_diloco
from lightning_llmpar.fault_tolerance.replica_env import ReplicaGroupEnv
from lightning_llmpar.training.logged_loss import shadowed

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torchft import Manager

__all__ = ["CommitOnQuorum", "ReplicaGroups"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class CommitOnQuorum(torch.optim.Optimizer):
    """torchft's ``OptimizerWrapper`` reordered for Lightning: the quorum starts before the closure (Lightning
    zeroes gradients inside the closure, after the forward), and the wrapped optimizer steps only on commit."""

    def __init__(self, manager: Manager, optimizer: torch.optim.Optimizer, on_decided: Callable[[bool], None],
                 lighthouse: str) -> None:
        # Not Optimizer.__init__: every field is the wrapped optimizer's (the LR scheduler holds that one).
        self.manager, self.optim, self._on_decided, self._lighthouse = manager, optimizer, on_decided, lighthouse
        self._optimizer = optimizer  # what checkpoint code unwraps to

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        try:
            self.manager.start_quorum()
        except TimeoutError as err:  # torchft's own message is a bare RPC status
            waited = getattr(self.manager, "_quorum_timeout", None)
            raise RuntimeError(
                f"No quorum within the quorum timeout{f' ({waited.total_seconds():.0f} s)' if waited else ''}: the"
                f" lighthouse at {self._lighthouse} is down or unreachable (or never had its"
                " --min-replicas groups). Every replica group"
                " stops here, having committed nothing since; restart the lighthouse (`llmpar lighthouse`) and resume"
                " the groups from their last checkpoint. The timeout is the strategy's `timeout`, or"
                " TORCHFT_QUORUM_TIMEOUT_SEC."
            ) from err
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        committed = self.manager.should_commit()  # heals this group first if the quorum said so
        if committed:
            self.optim.step()
        self._on_decided(committed)
        return loss


class ReplicaGroups:
    """This job's torchft manager and what the strategy asks of it (sampler shard, gradient average, shutdown)."""

    def __init__(self, strategy: Any, trainer: pl.Trainer, timeout: timedelta, diloco: DiLoCoConfig | None = None) -> None:
        from torchft import Manager, ProcessGroupGloo

        env = ReplicaGroupEnv.from_env()

        if strategy.root_device.type != "cpu":
            raise ValueError(
                f"fault_tolerance='torchft' runs its cross-group gradient average on gloo and has only been checked on"
                f" CPU; this run is on {strategy.root_device}. Use accelerator='cpu', or fault_tolerance=None."
            )
        if not trainer.lightning_module.automatic_optimization:
            raise ValueError(
                "fault_tolerance='torchft' commits or discards the optimizer step Lightning takes in automatic"
                f" optimization; {type(trainer.lightning_module).__name__} sets automatic_optimization=False."
            )
        if diloco is not None and len(strategy.optimizers) != 1:
            raise ValueError(
                f"data_parallel_sync='diloco' steps one inner optimizer; {type(trainer.lightning_module).__name__}"
                f" configures {len(strategy.optimizers)}."
            )
        self.env, self.trainer, self.strategy, self.diloco = env, trainer, strategy, diloco
        self.committed_steps, self.uncommitted_steps = 0, 0
        self._pg = ProcessGroupGloo(timeout=timeout)  # the gloo group across replica groups, rebuilt at each new quorum
        self.manager = Manager(
            pg=self._pg,
            load_state_dict=self._load_state_dict, state_dict=self._state_dict,
            min_replica_size=1,
            # A synchronous quorum heals a restarted group before its forward, so its gradients count that very
            # step (the asynchronous one overlaps the RPC with the forward but leaves a healing group out).
            use_async_quorum=False,
            # DiLoCo's first quorum comes after the first steps, not before: see diloco.start_diloco.
            init_sync=diloco is None,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=env.connect_timeout or timeout,
            rank=strategy.global_rank, world_size=strategy.world_size,
            store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=env.lighthouse,
            replica_id=f"llmpar_group_{env.replica_id}",
        )
        self._local_sgd: Any = None  # DiLoCo: started at the first optimizer step
        self.outer = outer_optimizer(strategy.model, diloco) if diloco is not None else None  # checkpointed
        self._hooks = ExitStack()  # the module's hooks this run replaces, put back at shutdown
        self._discarded = False  # the optimizer step just taken was not committed
        if diloco is None:
            strategy.optimizers = [CommitOnQuorum(self.manager, opt, self._decided, env.lighthouse)
                                   for opt in strategy.optimizers]
            self._hold_step_schedulers(trainer.lightning_module)
            self._hold_discarded_logs(trainer)

    def _hold_step_schedulers(self, module: pl.LightningModule) -> None:
        """Lightning steps a per-step LR scheduler after every optimizer step, also one the quorum discarded: it
        would run one step ahead per discarded step. Such an update is skipped, through the module's
        ``lr_scheduler_step`` hook (shadowed on the instance until shutdown), so the schedule counts committed steps."""
        step_scheduler, per_step = module.lr_scheduler_step, {id(c.scheduler) for c in self.strategy.lr_scheduler_configs
                                                              if c.interval == "step"}

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            if not (self._discarded and id(scheduler) in per_step):
                step_scheduler(scheduler, metric)

        self._hooks.enter_context(shadowed(module, "lr_scheduler_step", lr_scheduler_step))

    def _hold_discarded_logs(self, trainer: pl.Trainer) -> None:
        """A discarded step's metrics are not sent to the loggers: it trained nothing and is taken again."""
        connector = trainer._logger_connector
        update = connector.update_train_step_metrics

        def update_train_step_metrics() -> None:
            if not self._discarded:
                update()

        self._hooks.enter_context(shadowed(connector, "update_train_step_metrics", update_train_step_metrics))

    def on_train_start(self) -> None:
        """After a checkpoint is restored. torchft counts committed steps from zero, Lightning from the checkpoint's
        step; the quorum heals every group from the one at the highest step, and ``_decided`` makes a group's count
        Lightning's. So torchft's count starts at the checkpoint's: else a group started afresh beside a resumed
        one would not heal from it, and the resumed group's step count would start again at 1."""
        if self.trainer.global_step == 0:
            self._wait_for_groups()
        if self.diloco is None and self.trainer.global_step:
            self.manager.load_state_dict({"step": self.trainer.global_step, "batches_committed": 0})

    def _wait_for_groups(self) -> None:
        """A fresh start waits (at most the quorum timeout) until every group's manager heartbeats: a quorum holds
        only groups the lighthouse has heard from, so a group that asked first trained alone, on its shard."""
        if self.strategy.global_rank == 0:
            timeout = getattr(self.manager, "_quorum_timeout", timedelta(minutes=30)).total_seconds()
            start = said = time.monotonic()
            while (seen := _heartbeating(self.env.lighthouse)) is not None and seen < self.env.num_groups:
                if time.monotonic() - start > timeout:
                    break
                if time.monotonic() - said > 30:
                    said = time.monotonic()
                    print(f"Replica group {self.env.replica_id}: waiting up to {timeout:.0f} s (the quorum timeout) for"
                          f" NUM_REPLICA_GROUPS={self.env.num_groups} groups; {seen} heartbeat.", flush=True)
                time.sleep(0.2)
        self.strategy.barrier("llmpar_replica_groups_start")

    def sampler_kwargs(self, within_group: dict[str, Any]) -> dict[str, Any]:
        # Group g takes the shards one job with G x dp data-parallel ranks would give its ranks g*dp .. g*dp+dp-1.
        dp = within_group["num_replicas"]
        return {"num_replicas": self.env.num_groups * dp, "rank": self.env.replica_id * dp + within_group["rank"]}

    # ------------------------------------------------------------------ gradients

    def averaging(self, closure: Callable[[], Any], optimizer: Any) -> Callable[[], Any]:
        """``closure`` followed by the gradient average over the live groups: before clipping and the step,
        which Lightning's precision plugin runs after the closure."""
        if self.diloco is not None:
            if self._local_sgd is None:
                # Started at the first step, not at set-up: its backup of the last synced weights must hold what
                # training starts from (a checkpoint is restored after set-up), and its first quorum, which gives
                # every group the first group's weights, must meet the other groups where they start to train.
                self._local_sgd = start_diloco(self.manager, self.strategy.model, optimizer, self.outer, self.diloco)
            return closure  # gradients stay in the group; the weights are averaged every `diloco.every` steps
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]

        def closure_then_average() -> Any:
            out = closure()
            self.average_gradients(params)
            return out

        return closure_then_average

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        # One flat all-reduce per dtype: every group has the same parameters and layout, so the same offsets.
        # A parameter without a gradient sends zeros (the buffers must match) and keeps no gradient.
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor | None, torch.Tensor]]] = {}
        for p in params:
            grad = None if p.grad is None else _local(p.grad)
            by_dtype.setdefault(p.dtype, []).append((grad, _local(p)))
        for pairs in by_dtype.values():
            flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in pairs])
            self.manager.allreduce(flat).wait()  # errors are recorded by the manager: the step then does not commit
            offset = 0
            for g, p in pairs:
                n = p.numel()
                if g is not None:
                    g.copy_(flat[offset : offset + n].view_as(g))
                offset += n

    def _decided(self, committed: bool) -> None:
        # Lightning counts every optimizer step; keep its count (max_steps, schedules, checkpoints) equal to the
        # committed steps, so a discarded step is taken again and a healed group continues at its peers' step.
        if committed:
            self.committed_steps += 1
            first = self.committed_steps == 1 and self.manager.current_step() == 1  # a fresh start, not a heal
            if first and self.manager.num_participants() < self.env.num_groups:
                rank_zero_warn(
                    f"Replica group {self.env.replica_id} committed its first step with"
                    f" {self.manager.num_participants()} of NUM_REPLICA_GROUPS={self.env.num_groups} groups: the others"
                    " had not started within the quorum timeout, so it trains without them (on its shard only) until"
                    " they join and heal from it. Start every group's job within TORCHFT_QUORUM_TIMEOUT_SEC (the"
                    " strategy's `timeout`) of the first."
                )
        else:
            self.uncommitted_steps += 1
        self._discarded = not committed
        # The loggers' step: Lightning logs this batch at it, then counts the batch (skipped: _hold_discarded_logs).
        self.trainer.fit_loop.epoch_loop._batches_that_stepped = self.manager.current_step() - 1
        progress = self.trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        progress.ready = self.manager.current_step()
        progress.completed = self.manager.current_step() - 1  # Lightning adds the one it is taking

    # ------------------------------------------------------------------ healing

    def _state_dict(self) -> dict[str, Any]:
        s = self.strategy
        return {
            "model": {k: _local(v).detach().clone() for k, v in s.model.state_dict().items()},
            "optimizers": [_locals(_inner(opt).state_dict()) for opt in s.optimizers],
            "schedulers": [cfg.scheduler.state_dict() for cfg in s.lr_scheduler_configs],
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.strategy
        with torch.no_grad():
            for k, v in s.model.state_dict().items():
                _local(v).copy_(state["model"][k])
        for opt, sd in zip(s.optimizers, state["optimizers"]):
            _inner(opt).load_state_dict(_as_params(_inner(opt), sd))
        for cfg, sd in zip(s.lr_scheduler_configs, state["schedulers"]):
            cfg.scheduler.load_state_dict(sd)

    def shutdown(self) -> None:
        self._hooks.close()
        if self._local_sgd is not None:
            self._local_sgd.__exit__(None, None, None)  # removes its hooks from the optimizer
            self._local_sgd = None
        self.manager.shutdown(wait=False)
        # torchft's shutdown leaves the cross-group gloo group alive, with its worker and transport threads, until
        # the interpreter collects it at exit. Released here, while Python runs: its destructor joins those threads,
        # and a second fit in the same process does not keep the first one's.
        self._pg.shutdown()


def _heartbeating(lighthouse: str) -> int | None:
    """How many replica groups heartbeat at the lighthouse, from its status page (None where it cannot be read)."""
    try:
        with urllib.request.urlopen(f"{lighthouse.rstrip('/')}/status", timeout=5) as page:
            found = re.search(r"\[(\d+) heartbeating\]", page.read().decode(errors="replace"))
    except OSError:
        return None
    return int(found.group(1)) if found else None


def _inner(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return opt.optim if isinstance(opt, CommitOnQuorum) else opt


def _locals(sd: dict[str, Any]) -> dict[str, Any]:
    state = {i: {k: _local(v).detach().clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
             for i, st in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def _as_params(optim: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    # The peer sent local shards; this group's parameters have the same layout, so each becomes a DTensor again
    # where its parameter is one (the optimizer state of a sharded parameter must be sharded like it).
    params = [p for g in optim.param_groups for p in g["params"]]
    state = {}
    for i, st in sd["state"].items():
        p = params[int(i)]
        state[i] = {
            k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0 else v
            for k, v in st.items()
        }
    return {"state": state, "param_groups": sd["param_groups"]}
