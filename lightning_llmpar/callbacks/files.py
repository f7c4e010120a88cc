"""Where a run writes its own files, under names that never replace a file it did not write."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch import Trainer

__all__ = ["free_stem", "run_folder"]


def free_stem(folder: str | Path, stem: str, suffixes: tuple[str, ...]) -> Path:
    """``folder/stem``, or the first ``folder/stem-N``, such that no ``<it><suffix>`` exists for any of ``suffixes``
    (a file and its companions, e.g. a picture and its data, keep one name)."""
    folder, n = Path(folder), 0
    candidate = folder / stem
    while any(Path(f"{candidate}{suffix}").exists() or Path(f"{candidate}{suffix}").is_symlink() for suffix in suffixes):
        n += 1
        candidate = folder / f"{stem}-{n}"
    return candidate


def run_folder(trainer: Trainer) -> str:
    """The folder of this run's logs and default checkpoints (rank 0's answer; W&B names it on rank 0 only)."""
    if not trainer.loggers:
        return str(trainer.default_root_dir)
    logger = trainer.loggers[0]
    version = logger.version
    return os.path.join(logger.save_dir or trainer.default_root_dir, str(logger.name),
                        version if isinstance(version, str) else f"version_{version}")
