"""The `llmpar` command: LightningCLI over the example GPT and the offline corpus, W&B offline by default."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ModelSummary
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

import lightning_llmpar  # noqa: F401 - registers the strategy names
from lightning_llmpar.callbacks.throughput import ThroughputAndMemory
from lightning_llmpar.callbacks.timeline import PipelineTimeline
from lightning_llmpar.cli.progress import step_progress_bar
from lightning_llmpar.cli.resume import newest_run_checkpoint
from lightning_llmpar.cli.saved_config import KeepingSaveConfig
from lightning_llmpar.cli.summary import model_summary
from lightning_llmpar.cli.warnings import quiet_known_warnings
from lightning_llmpar.fault_tolerance.position import DataPosition

__all__ = ["LLMParCLI", "main", "console"]


class _PeriodicCheckpoint(ModelCheckpoint):
    """The command's default checkpoint: every ``every_n_train_steps`` steps and at the end of training.

    ModelCheckpoint saves ``last`` at the end only when it has never saved, so a run whose length is not a multiple
    of the period ended with a stale ``last``, which the command reports as the run's checkpoint. The last step is
    saved where the periodic saves are, when the run is known to stop (``max_steps``, ``max_time`` at a batch's end,
    a preemption's SIGTERM, early stopping at a validation's): by the end of training Lightning counts the epoch as
    finished, and a run resumed from a checkpoint saved there would start the next epoch's data."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        preempted = getattr(trainer.strategy, "preempted", False)  # a SIGTERM: this step is the last
        if 0 < trainer.max_steps <= trainer.global_step or trainer.should_stop or preempted:
            self._save_last_now(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.should_stop and not trainer.sanity_checking:
            self._save_last_now(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save_last_now(trainer)  # runs that end otherwise (the last epoch's end: nothing of it is left)

    def _save_last_now(self, trainer: Trainer) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # skipped when this step is saved already
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def _strategy_from_path(name: str) -> str | Strategy:
    """``--trainer.strategy lightning_llmpar.LLMParallelStrategy`` alone: jsonargparse keeps a bare class path as a
    string, the Trainer's strategy name, which Lightning refuses; the class is built with its defaults (as with
    ``class_path`` and no ``init_args``). Other unknown names go on to Lightning, whose error lists the names."""
    module, _, attr = name.rpartition(".")
    if not module:
        return name
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--trainer.strategy {name}: neither a registered strategy name nor an importable class"
                         f" ({err}). Give a name (e.g. llmpar_fsdp) or a class path such as"
                         " lightning_llmpar.LLMParallelStrategy.") from None
    if not (isinstance(found, type) and issubclass(found, Strategy)):
        raise ValueError(f"--trainer.strategy {name}: {found!r} is not a Lightning Strategy class.")
    return found()


class LLMParCLI(LightningCLI):
    """Any LightningModule and DataModule (``--model my_pkg.MyModule --data my_pkg.MyData``); the example GPT and
    the offline corpus are the defaults, so configs that only set their arguments keep working."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({
            "model": {"class_path": "lightning_llmpar.models.GPTModule"},
            "data": {"class_path": "lightning_llmpar.data.CorpusDataModule"},
        })
        # Applied when the chosen classes take these arguments (the example GPT's rotary tables, schedules).
        parser.link_arguments("data.init_args.block_size", "model.init_args.block_size")
        parser.link_arguments("trainer.max_steps", "model.init_args.total_steps")

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        # A periodic checkpoint and a step-aware progress bar unless the run turns them off
        # (--trainer.enable_checkpointing=false, --trainer.enable_progress_bar=false) or brings its own.
        given = config.get("callbacks") or []
        given = [*(given if isinstance(given, list) else [given]), *callbacks]
        extra = list(callbacks)
        if isinstance(config.get("strategy"), str) and config["strategy"] not in StrategyRegistry:
            config = {**config, "strategy": _strategy_from_path(config["strategy"])}
        if config.get("enable_checkpointing") is not False and not any(isinstance(c, ModelCheckpoint) for c in given):
            extra.append(_PeriodicCheckpoint(dirpath=None, save_last=True, every_n_train_steps=50))
        if not any(isinstance(c, DataPosition) for c in given):  # a mid-epoch resume goes on with the epoch
            extra.append(DataPosition())
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            extra.append(step_progress_bar())
        if config.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in given):
            extra.append(model_summary())
        if config.get("logger") not in (False, None, []):  # a learning-rate monitor needs somewhere to log
            extra.append(LearningRateMonitor(logging_interval="step"))
        trainer = super()._instantiate_trainer(config, extra)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and getattr(logger, "_wandb_init", {}).get("anonymous", 0) is None:
                # Lightning passes anonymous=None to wandb.init, which warns that the setting is gone; unset: quiet.
                del logger._wandb_init["anonymous"]
        return trainer

    def before_fit(self) -> None:
        # A mistyped --ckpt_path is refused here, before any process starts, not after set-up on every rank.
        path = self.config_init[self.subcommand].get("ckpt_path")
        if path == "last" and (newest := newest_run_checkpoint(self.trainer, self._config_dict())) is not None:
            rank_zero_info(f"llmpar: resuming from {newest}, the newest complete checkpoint of an earlier run of this"
                           " model and data config")
            self.config_init[self.subcommand]["ckpt_path"] = path = str(newest)
        if (isinstance(path, str) and path not in ("last", "best", "hpc") and not path.startswith("registry")
                and not Path(path).expanduser().exists()):
            raise ValueError(f"--ckpt_path {path}: nothing by that name exists. Give a checkpoint folder the run wrote"
                             " (e.g. runs/llmpar/<run-id>/checkpoints/last.ckpt), or 'last'.")

    def _config_dict(self) -> dict[str, Any]:
        """This run's config as the run folder's ``config.yaml`` will hold it (the same dump, read back)."""
        dumped = self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False)
        return yaml.safe_load(dumped)

    def after_fit(self) -> None:
        self._report()

    @rank_zero_only
    def _report(self) -> None:
        trainer = self.trainer
        ckpt = trainer.checkpoint_callback
        path = getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")
        print(f"\nllmpar: layout {getattr(trainer.strategy, 'layout', 'single device')}")
        print(f"llmpar: checkpoint  {Path(path).resolve() if path else '(none written)'}")
        for callback in trainer.callbacks:
            if isinstance(callback, KeepingSaveConfig) and callback.saved_path:
                print(f"llmpar: config      {Path(callback.saved_path).resolve()}")
        for callback in trainer.callbacks:
            if isinstance(callback, PipelineTimeline) and callback.last_picture is not None:
                print(f"llmpar: timeline    {callback.last_picture.resolve()}")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                run = logger.experiment
                run_dir = Path(run.dir).parent.resolve()
                run.finish()  # flush history and summary now, not in an exit hook that may not run
                print(f"llmpar: W&B run     {run_dir} (offline: `wandb sync <dir>` uploads it)")
            else:
                print(f"llmpar: logs        {logger.log_dir}")


def main(args: list[str] | None = None, run: bool = True) -> LLMParCLI:
    # Offline unless the user asks otherwise: nothing in a default run needs a network.
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    quiet_known_warnings()
    return LLMParCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=1234,
        save_config_callback=KeepingSaveConfig,
        trainer_defaults={
            "logger": {
                "class_path": "lightning.pytorch.loggers.WandbLogger",
                "init_args": {"project": "llmpar", "save_dir": "runs", "offline": True},
            },
            "callbacks": [
                ThroughputAndMemory(),
                PipelineTimeline(),
            ],
        },
        args=args,
        run=run,
    )


def verify(args: list[str]) -> int:
    """`llmpar verify --config my.yaml`: the parity self-check of a `llmpar fit` config (see lightning_llmpar.verify)."""
    import argparse
    import sys
    from unittest import mock

    from lightning_llmpar.strategies.registry import PRESETS
    from lightning_llmpar.verify import verify_parity

    parser = argparse.ArgumentParser(prog="llmpar verify", description=verify.__doc__)
    parser.add_argument("--config", required=True, help="a llmpar fit config (model, data, trainer.strategy, devices)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="relative, per step and per parameter")
    parser.add_argument("--lr", type=float, default=1e-2, help="SGD learning rate of both runs")
    parser.add_argument("--devices", type=int, default=None, help="processes for the layout (default: the config's)")
    opts, overrides = parser.parse_known_args(args)
    if opts.steps < 1:  # the batch count would never be reached: the whole epoch, twice
        parser.error(f"--steps must be at least 1, got {opts.steps}")
    if not opts.tolerance > 0:  # a verdict against a negative (or NaN) tolerance would always be FAIL
        parser.error(f"--tolerance must be a positive relative difference such as 1e-4, got {opts.tolerance}")
    if opts.devices is not None:
        overrides += ["--trainer.devices", str(opts.devices)]
    # LightningCLI reads sys.argv too (and names it in its errors): make it this command's alone.
    with mock.patch.object(sys, "argv", ["llmpar verify"]):
        cfg = main(["--config", opts.config, *overrides], run=False).config
    strategy = cfg.trainer.strategy
    if isinstance(strategy, str) and strategy in PRESETS:
        layout = dict(PRESETS[strategy][1])
    elif isinstance(strategy, dict) or hasattr(strategy, "init_args"):
        layout = dict(strategy.init_args)
    else:
        parser.error(f"trainer.strategy is {strategy!r}: give an LLMParallelStrategy (class_path and init_args) or a"
                     f" registered name ({', '.join(PRESETS)})")
    skipped = _not_verified(cfg.trainer)
    if skipped:
        print(f"llmpar verify: not applied from the config (both runs are fp32, SGD, no callbacks): {skipped}")
    report = verify_parity(
        cfg.model.class_path, cfg.data.class_path, layout, int(cfg.trainer.devices),
        model_kwargs=dict(cfg.model.init_args), data_kwargs=dict(cfg.data.init_args), steps=opts.steps,
        tolerance=opts.tolerance, lr=opts.lr, accelerator=str(cfg.trainer.accelerator or "cpu"),
    )
    return 0 if report.passed else 1


def _not_verified(trainer: Any) -> str:
    """The trainer settings of a fit config that the parity check leaves out, as `key=value` pairs."""
    defaults = {"precision": (None, "32-true", "32", 32), "plugins": (None, []), "callbacks": (None, []),
                "accumulate_grad_batches": (1,), "gradient_clip_val": (None, 0, 0.0), "num_nodes": (1,)}
    return ", ".join(f"trainer.{key}={trainer.get(key)!r}" for key, plain in defaults.items()
                     if trainer.get(key) not in plain)


def console() -> None:
    """Entry point of the `llmpar` command (returns nothing, so the exit status is 0 on success; 143 after a
    SIGTERM stopped training)."""
    import signal
    import sys

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    quiet_known_warnings()
    if sys.argv[1:2] == ["verify"]:
        sys.exit(verify(sys.argv[2:]))
    if sys.argv[1:2] == ["plan"]:
        from lightning_llmpar.cli.plan import plan_command

        sys.exit(plan_command(sys.argv[2:]))
    if sys.argv[1:2] == ["lighthouse"]:
        from lightning_llmpar.cli.lighthouse import lighthouse_command

        sys.exit(lighthouse_command(sys.argv[2:]))
    try:
        main()
        # Every rank is done: the process groups go now, not in the interpreter's exit, where gloo's threads
        # outliving Python aborted a finished run now and then ("terminate called without an active exception").
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except SIGTERMException:
        # Lightning stops a SIGTERMed run with a bare SystemExit, status 0: a scheduler's retry policy would count
        # the preempted run as finished. The status a SIGTERM gives a process that does not handle it instead.
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    console()
