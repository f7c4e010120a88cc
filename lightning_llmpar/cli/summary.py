"""Lightning's model summary without a FLOPs column it cannot fill.

Lightning counts FLOPs by running the module's ``example_input_array`` through it on rank 0 alone; without one (or
with the model split over ranks, where one rank cannot run it) it prints a column of zeros and "Total FLOPs: 0".
The throughput callback logs the FLOPs of a step, counted once per device, instead.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.callbacks.model_summary import log
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count

__all__ = ["RichSummaryWithoutFlops", "SummaryWithoutFlops", "model_summary"]

_RIGHT = {"Params", "Params per Device", "In sizes", "Out sizes"}


def _without_flops(summary_data: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    return [(name, values) for name, values in summary_data if name != "FLOPs"]


class SummaryWithoutFlops(ModelSummary):
    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int, **kwargs: Any) -> None:
        if total_flops:
            ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                   total_training_modes, total_flops, **kwargs)
            return
        rows = list(zip(*(values for _, values in _without_flops(summary_data)), strict=True))
        names = [name for name, _ in _without_flops(summary_data)]
        widths = [max(len(str(x)) for x in (name, *(r[i] for r in rows))) for i, name in enumerate(names)]
        lines = [" | ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)) for row in [names, *rows]]
        lines.insert(1, "-" * len(lines[0]))
        totals = _totals(total_parameters, trainable_parameters, model_size, total_training_modes)
        log.info("\n".join(["", *lines, "-" * len(lines[0]), *totals]))


class RichSummaryWithoutFlops(RichModelSummary):
    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int, **kwargs: Any) -> None:
        if total_flops:
            RichModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                       total_training_modes, total_flops, **kwargs)
            return
        from rich import get_console
        from rich.table import Table

        table = Table(header_style=kwargs.get("header_style", "bold magenta"))
        columns = _without_flops(summary_data)
        for name, _ in columns:
            table.add_column(name, justify="right" if name in _RIGHT else "left", style="dim" if name == " " else None)
        for row in zip(*(values for _, values in columns), strict=True):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        for line in _totals(total_parameters, trainable_parameters, model_size, total_training_modes):
            name, value = line.split(": ", 1)
            grid.add_row(f"[bold]{name}[/]: {value}")
        console.print(grid)


def _totals(total: int, trainable: int, size: float, modes: dict[str, int]) -> list[str]:
    return [
        f"Trainable params: {get_human_readable_count(int(trainable))}",
        f"Non-trainable params: {get_human_readable_count(int(total - trainable))}",
        f"Total params: {get_human_readable_count(int(total))}",
        f"Total estimated model params size (MB): {get_formatted_model_size(size)}",
        f"Modules in train mode: {modes['train']}",
        f"Modules in eval mode: {modes['eval']}",
    ]


def model_summary() -> ModelSummary:
    """The summary Lightning would pick (rich when installed), without the FLOPs column when it counted none."""
    return RichSummaryWithoutFlops() if _RICH_AVAILABLE else SummaryWithoutFlops()
