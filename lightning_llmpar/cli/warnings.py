"""Known-harmless library warnings: shown once per run (by rank 0), not once per process."""

from __future__ import annotations

import os
import warnings

__all__ = ["KNOWN_HARMLESS", "quiet_known_warnings"]

# Message prefixes (regular expressions) of warnings every rank would print identically.
KNOWN_HARMLESS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning's pytree helper on torch >= 2.10
    # Under pipeline parallelism only the last stage computes the loss, so metrics updated from it stay
    # empty on the other stages' ranks.
    r"The ``compute`` method of metric .* was called before the ``update`` method",
)


def quiet_known_warnings() -> None:
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)
    for pattern in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore" if rank else "once", message=pattern)
