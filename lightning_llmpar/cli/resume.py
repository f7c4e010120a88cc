"""``--ckpt_path last`` across runs: the newest complete checkpoint of an earlier run of the same model and data.

Each ``llmpar fit`` run writes into a folder of its own (``save_dir/name/<run>``), where Lightning looks for "last"
only in the new, empty one. The command looks in the runs beside it instead; runs of other configs share that
folder (a sweep, yesterday's experiment), so the newest of them is not necessarily this run's: a checkpoint of
another model of the same shapes would load without a word. A run counts when the ``model`` and ``data`` sections
of the config it saved equal this run's (trainer settings, the layout included, and the loaders' worker settings
may change on resume); a run that saved no config is taken on trust.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["COMPARED", "config_differences", "newest_run_checkpoint"]

COMPARED = ("model", "data")  # the config sections that must be equal for a run's "last" to be this run's
# Loader settings that change how fast batches come, never which: a resume may change them.
LOADER_ONLY = frozenset({"num_workers", "pin_memory", "persistent_workers", "prefetch_factor"})


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): value}


def config_differences(earlier: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``"model.init_args.n_embd: 64 -> 128"`` for each compared setting that differs between two configs."""
    a = _flat({s: earlier.get(s) for s in COMPARED})
    b = _flat({s: now.get(s) for s in COMPARED})
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in sorted(a.keys() | b.keys())
            if a.get(k, "(unset)") != b.get(k, "(unset)") and k.rpartition(".")[2] not in LOADER_ONLY]


def _saved_config(run: Path) -> dict[str, Any] | None:
    """The config a run saved (``config.yaml``, the name ``KeepingSaveConfig`` gives it in a fresh run folder),
    read as plain YAML (``safe_load``: nothing in it is executed); None if it saved none or it cannot be read."""
    try:
        saved = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def newest_run_checkpoint(trainer: Trainer, config: dict[str, Any] | None = None) -> Path | None:
    """For ``--ckpt_path last`` with a checkpoint callback without a folder of its own (the command's default, or a
    user's ``ModelCheckpoint`` without ``dirpath``): the newest complete ``last`` checkpoint of the earlier runs
    whose saved ``model`` and ``data`` equal ``config``'s (every run's when ``config`` is None). None without a
    logger (one folder for every run, where Lightning finds it), with a ``dirpath`` (Lightning looks there), or
    when no earlier run saved one. ``ValueError`` when runs saved one but none of this config, naming the newest
    run's differences and how to resume it anyway."""
    from lightning_llmpar.checkpointing.scan import checkpoint_problem

    ckpt = trainer.checkpoint_callback
    if not isinstance(ckpt, ModelCheckpoint) or ckpt.dirpath is not None or not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    runs = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name)
    found = sorted((p for p in runs.glob("*/checkpoints/last*.ckpt") if p.is_file() or checkpoint_problem(p) is None),
                   key=lambda p: p.stat().st_mtime, reverse=True)
    if config is None or not found:
        return found[0] if found else None
    differences = {}
    for path in found:
        saved = _saved_config(path.parent.parent)
        differences[path] = [] if saved is None else config_differences(saved, config)
        if not differences[path]:
            return path
    newest = found[0]
    listed = "; ".join(differences[newest][:6]) + ("; ..." if len(differences[newest]) > 6 else "")
    raise ValueError(
        f"--ckpt_path last: none of the {len(found)} earlier run(s) under {runs} with a complete checkpoint has this"
        f" run's model and data config. The newest, {newest.parent.parent.name}, differs in {listed}. To resume it"
        f" with these settings, give its checkpoint: --ckpt_path {newest}; to start afresh, drop --ckpt_path.")
