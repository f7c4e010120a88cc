"""Known-harmless library warnings: shown once per run (by rank 0), not once per process; per-process info lines
of Lightning said by rank 0 only."""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["KNOWN_HARMLESS", "quiet_known_warnings"]

# Message prefixes (regular expressions) of warnings every rank would print identically.
KNOWN_HARMLESS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning's pytree helper on torch >= 2.10
    # Under pipeline parallelism only the last stage computes the loss, so metrics updated from it stay
    # empty on the other stages' ranks (their compute still takes part in the sync that gives the value).
    r"The ``compute`` method of metric .* was called before the ``update`` method",
    # A pipeline stage under FSDP2 returns its activation as a view; only torch's schedule reads it (sent or fed to the
    # loss, never changed in place), so the hook it warns about is not skipped (the pipeline x ZeRO tests are exact).
    r"FSDP2-wrapped module \(FSDPStageModule\) returned a view tensor",
)
# Lightning's lines every process logs for itself ("[rank: 3] Seed set to 1234", "Initializing distributed:
# GLOBAL_RANK: 3, ..."): rank 0's stand for all.
PER_PROCESS_LOGGERS = ("lightning.fabric.utilities.seed", "lightning.fabric.utilities.distributed")


class _DropTips(logging.Filter):
    """Lightning's advertisement for a hosted logger, printed by every run that does not use it, and its note that
    the command brought its own model summary (cli/summary.py), which it does on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("💡 Tip", "Trainer already configured with model summary"))


_DROP_TIPS = _DropTips()


class _DropImportNoise(logging.Filter):
    """What importing torchao says in every process (transformers imports it whenever it is installed): that its
    CUDA kernel libraries do not load, on a machine without CUDA where nothing would call them, and torch's
    deprecation of the pytree registration torchao makes for its enums."""

    def filter(self, record: logging.LogRecord) -> bool:
        import torch

        text = str(record.msg)
        if text.startswith("%s is an Enum subclass"):
            return False
        return not (text.startswith("Failed to load") and ".so" in text and not torch.cuda.is_available())


_DROP_IMPORT_NOISE = _DropImportNoise()


def _show_once(show: Callable[..., None]) -> Callable[..., None]:
    shown: set[tuple[type, str]] = set()

    @functools.wraps(show)
    def show_once(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if (category, str(message)) not in shown:
            shown.add((category, str(message)))
            show(message, category, *args, **kwargs)

    show_once._shows_once = True  # type: ignore[attr-defined]
    return show_once


def quiet_known_warnings() -> None:
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)
    for pattern in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore" if rank else "once", message=pattern)
    # The "once" filter alone is not enough: in a pipeline run rank 0 showed Lightning's pytree warning again at
    # each validation, filter or not. Each text is shown once per process.
    if not getattr(warnings.showwarning, "_shows_once", False):
        warnings.showwarning = _show_once(warnings.showwarning)
    if rank:
        for name in PER_PROCESS_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DROP_TIPS)  # once, however often main() runs
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).addFilter(_DROP_IMPORT_NOISE)
