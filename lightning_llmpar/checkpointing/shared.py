"""A checkpoint folder every rank sees: checked before a save writes anything.

A distributed save has each rank write its own shards into the folder and rank 0 commit it. Given a path on a node's
own disk (``/tmp``, a local SSD), the ranks of other nodes wrote their shards where rank 0 never looks: the commit
then recorded, and checksummed, an incomplete checkpoint, and only a resume found it out, however many periodic
saves later. Rank 0 writes a fresh token into the staging folder; a rank that cannot read it back stops the save on
every rank, naming the folder.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["check_shared_folder"]

_TOKEN = ".llmpar-visible"


def check_shared_folder(staging: Path, *, is_rank_zero: bool, broadcast: Callable[[Any], Any] | None,
                        agree: Callable[[bool], bool] | None) -> None:
    """Raise ``ValueError`` on every rank unless every rank reads what rank 0 wrote into ``staging`` (a collective);
    leaves ``staging`` empty and in place when they do, removed when they do not. Nothing without both callables."""
    if broadcast is None or agree is None:
        return
    token = broadcast(uuid.uuid4().hex if is_rank_zero else None)
    marker = staging / _TOKEN
    if is_rank_zero:
        staging.mkdir(parents=True)
        marker.write_text(token)
    agree(True)  # rank 0's token is written before any rank looks
    try:
        seen = marker.read_text() == token
    except OSError:
        seen = False
    everyone = agree(seen)
    if is_rank_zero:
        marker.unlink()
        if not everyone:
            staging.rmdir()
    if not everyone:
        raise ValueError(
            f"Checkpoint folder {staging.parent}: {'this rank' if not seen else 'another rank'} does not see the files"
            " rank 0 writes there, so each node would write its shards onto its own disk and rank 0 would commit an"
            " incomplete checkpoint. Save to a folder every node shares (a shared filesystem). Nothing was written."
        )
