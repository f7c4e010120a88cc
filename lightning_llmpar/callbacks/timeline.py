"""See the pipeline: the actions each stage really ran, their times, the idle share, and a picture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger

from lightning_llmpar.callbacks.files import free_stem, run_folder
from lightning_llmpar.pipeline.stages import bubble_fraction

__all__ = ["PipelineTimeline", "draw_timeline", "bubble_fraction"]

_COLORS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}


def draw_timeline(ranks: list[dict[str, Any]], path: Path, title: str) -> Path:
    """One row per pipeline rank, one box per action (F/B/W) labelled stage:microbatch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.8 * len(ranks)))
    for row, rank in enumerate(ranks):
        t_start = rank["window"][0]
        for stage, kind, mb, t0, t1 in rank["actions"]:
            ax.broken_barh([((t0 - t_start) * 1e3, (t1 - t0) * 1e3)], (row - 0.4, 0.8), color=_COLORS.get(kind, "grey"))
            ax.text((t0 + t1 - 2 * t_start) * 500, row, f"{stage}:{mb}", ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)), [f"pp rank {r['rank']} ({100 * r['bubble']:.0f}% idle)" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since step start (F forward, B backward, W weight-gradient; label stage:microbatch)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, list(_COLORS), loc="upper right", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class PipelineTimeline(Callback):
    """Every ``every_n_steps`` steps, log the measured bubble fraction; at ``picture_at_step`` (and at
    the end of training) write the timeline of the last step as PNG + JSON next to the checkpoints and
    log the picture to W&B.
    """

    def __init__(self, every_n_steps: int = 10, picture_at_step: int = 5) -> None:
        for name, value, least in (("every_n_steps", every_n_steps, 1), ("picture_at_step", picture_at_step, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"PipelineTimeline: `{name}` must be an integer >= {least}, got {value!r}.")
        self.every, self.picture_at = every_n_steps, picture_at_step
        self.last_picture: Path | None = None

    def _collect(self, trainer: Trainer) -> list[dict[str, Any]] | None:
        runner = getattr(trainer.strategy, "pipeline_runner", None)
        if runner is None:
            return None
        mine = {
            "rank": runner.pp_rank,
            "actions": list(runner.timeline),
            "window": runner.step_window,
            "bubble": bubble_fraction(runner.timeline, runner.step_window),
        }
        gathered: list[Any] = [None] * dist.get_world_size(runner.pp_group)
        dist.all_gather_object(gathered, mine, group=runner.pp_group)
        return sorted(gathered, key=lambda r: r["rank"])

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int) -> None:
        step = trainer.global_step
        picture = step == self.picture_at or (trainer.max_steps > 0 and step == trainer.max_steps)
        if step % self.every and not picture:
            return
        ranks = self._collect(trainer)
        if ranks is None:
            return
        mean_bubble = sum(r["bubble"] for r in ranks) / len(ranks)
        pl_module.log("pipeline/bubble_fraction", mean_bubble, rank_zero_only=True)
        if picture and trainer.is_global_zero:
            self._write(trainer, ranks, step)

    def _write(self, trainer: Trainer, ranks: list[dict[str, Any]], step: int) -> None:
        runner = trainer.strategy.pipeline_runner  # type: ignore[attr-defined]
        ckpt = trainer.checkpoint_callback
        folder = Path(getattr(ckpt, "dirpath", None) or run_folder(trainer))  # the run's, with checkpointing off too
        title = (
            f"{runner.schedule_name}: {runner.layout.pp} ranks x {runner.layout.stages_per_rank} stages,"
            f" {runner.microbatches} microbatches (step {step})"
        )
        stem = free_stem(folder, f"pipeline_timeline_step{step}", (".png", ".json"))  # never over an existing file
        png = draw_timeline(ranks, stem.with_name(stem.name + ".png"), title)
        stem.with_name(stem.name + ".json").write_text(json.dumps(ranks))
        self.last_picture = png
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image("pipeline/timeline", [str(png)], step=step)
