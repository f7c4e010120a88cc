"""The run's config saved beside its checkpoints, never over a file the run did not write.

LightningCLI saves ``config.yaml`` into ``trainer.log_dir``. For W&B that is the logger's ``save_dir``, shared by every
run (each run replaced the last one's), and without a logger it is the current folder, where a ``config.yaml`` may be
the user's own (often the very file passed to ``--config``). This saves it into the run's own folder, the one that
holds its ``checkpoints/`` (``save_dir/name/version``, as ModelCheckpoint resolves it), and under the first free name
(``config-1.yaml``, ...) when that file exists.
"""

from __future__ import annotations

import os

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_llmpar.callbacks.files import free_stem, run_folder

__all__ = ["KeepingSaveConfig"]


class KeepingSaveConfig(SaveConfigCallback):
    """``SaveConfigCallback`` into the run's folder that never replaces a file; ``saved_path``: where it went."""

    saved_path: str | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        stem, dot, suffix = self.config_filename.rpartition(".")
        stem, suffix = (stem, dot + suffix) if dot else (self.config_filename, "")
        path = f"{free_stem(run_folder(trainer), stem, (suffix,))}{suffix}" if trainer.is_global_zero else None
        path = trainer.strategy.broadcast(path)
        if trainer.is_global_zero:
            folder = os.path.dirname(path)
            os.makedirs(folder, exist_ok=True)
            # overwrite=False: should the name be taken between the check and the write, the save fails, not replaces.
            self.parser.save(self.config, path, skip_none=False, overwrite=False, multifile=self.multifile)
            if os.path.basename(path) != self.config_filename:
                rank_zero_info(f"This run's config is saved as {path}: {os.path.join(folder, self.config_filename)}"
                               " exists and is not this run's.")
            self.save_config(trainer, pl_module, stage)
        self.saved_path = path
        self.already_saved = trainer.strategy.broadcast(True)
