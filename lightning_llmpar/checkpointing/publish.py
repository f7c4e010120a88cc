"""Putting a staged export in place: a whole folder swapped atomically, or files written beside a user's.

``save_hf_checkpoint`` into a folder that also holds the user's tokenizer, README and data writes beside them: it
replaces and removes only files its previous export wrote (its manifest lists them). A file of the same name as
one it writes (the weights or config of the model the run started from) is refused, and so are weight files it
would not replace: ``from_pretrained`` would read them with, or instead of, the new ones.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lightning_llmpar.checkpointing.dcp import commit_staging
from lightning_llmpar.checkpointing.manifest import (
    MANIFEST,
    _dump,
    describe,
    foreign_files,
    read_manifest,
    remove_tree,
    write_manifest,
)

__all__ = ["publish"]

_WEIGHTS = re.compile(r"\.(safetensors|bin|pt|pth|ckpt)(\.index\.json)?$")


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def publish(staging: Path, path: Path, kind: str) -> str | None:
    """Move the files of ``staging`` to ``path`` (rank 0); returns why it refused, or None once done."""
    if path.exists() and not path.is_dir():
        remove_tree(staging)
        return f"{path} is a file, not a folder; export to a folder."
    if not path.exists() or not foreign_files(path):
        commit_staging(staging, path, kind=kind)  # everything there is ours: one crash-consistent swap
        return None
    previous = read_manifest(path)
    old = dict(previous["files"]) if previous is not None else {}
    new = _files(staging)
    theirs = [n for n in _files(path) if n not in old]
    replaced = [n for n in theirs if n in new]
    if replaced:
        remove_tree(staging)
        return (f"{path} holds {', '.join(replaced[:5])}, which this export would replace and did not write (the"
                " model you started from?). Export to another folder, or move those files away.")
    stale = [n for n in theirs if "/" not in n and _WEIGHTS.search(n)]
    if stale:
        remove_tree(staging)
        return (f"{path} holds weight files this export would neither write nor replace ({', '.join(stale[:5])});"
                " from_pretrained would read them with, or instead of, the new weights. Move them away or export to"
                " another folder.")
    entries = describe(staging, new)
    # While files move, the manifest claims the old and the new ones: an interrupted export is still ours to
    # finish or replace, and a load finds the mismatch instead of reading a mix.
    _dump(path / MANIFEST, {"format": "llmpar-manifest/1", "kind": kind, "lineage": None, "checksum": "crc32",
                            "files": {**old, **entries}})
    for name in new:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / name, path / name)
    for name in old:
        if name not in entries:
            (path / name).unlink(missing_ok=True)
    write_manifest(path, kind, names=new)
    remove_tree(staging)
    return None
