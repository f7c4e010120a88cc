"""What a writer wrote: a small JSON manifest beside its files, so replacing and deleting touch only those, and
corruption is found before a load.

``llmpar-manifest.json`` lists every file the writer produced (relative path, size, CRC-32), the writer's kind
(``dcp``, ``deepspeed``, ``hf``, ``consolidated``) and a run lineage id (the run whose checkpoints these are, kept
across resumes). CRC-32 (zlib) was measured at ~3x blake2b's speed on the development machine
(benchmarks/checkpoint_integrity_bench.py) and catches any flipped bit or torn write; it is not a defence against
someone who edits a file on purpose (the safe readers are).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST",
    "checksum",
    "describe",
    "foreign_files",
    "owned_files",
    "read_manifest",
    "remove_owned",
    "remove_tree",
    "sidecar_of",
    "verify_manifest",
    "write_manifest",
    "write_sidecar",
]

MANIFEST = "llmpar-manifest.json"
LINEAGE_KEY = "llmpar_lineage"  # the checkpoint dict's entry naming the run lineage a save belongs to
_FORMAT = "llmpar-manifest/1"
_CHUNK = 8 << 20
# Files of a DCP checkpoint written before manifests existed: replaced or removed as this library's own.
_LEGACY = re.compile(r"^(\.metadata|meta\.pt|__\d+_\d+\.distcp|compression_rank\d+\.pt)$")


def checksum(file: Path) -> str:
    """CRC-32 of ``file`` as 8 hex digits (zlib releases the GIL on large buffers: files run in parallel)."""
    crc = 0
    with open(file, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def describe(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{relative name: {size, crc32}} of ``names`` under ``folder``."""
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
        sums = list(pool.map(lambda n: checksum(folder / n), names))
    return {n: {"size": (folder / n).stat().st_size, "crc32": c} for n, c in zip(names, sums)}


def _all_files(folder: Path) -> list[str]:
    """Every file under ``folder``; a symbolic link counts as one file, never followed (it may lead outside)."""
    found = []
    for root, dirs, files in os.walk(folder):  # followlinks=False: a linked folder is listed, not entered
        rel = Path(root).relative_to(folder)
        found += [str(rel / n) for n in files if n != MANIFEST]
        found += [str(rel / d) for d in dirs if os.path.islink(os.path.join(root, d))]
    return sorted(found)


def _through_link(folder: Path, name: str) -> bool:
    """Whether ``folder / name`` passes through a symbolic link below ``folder``: this library writes none, and a
    planted one can lead a manifest's name to a file outside the folder."""
    path = folder
    for part in Path(name).parts:
        path = path / part
        if path.is_symlink():
            return True
    return False


def write_manifest(folder: Path, kind: str, lineage: str | None = None, names: list[str] | None = None) -> dict[str, Any]:
    """Record ``names`` (default: every file under ``folder``) in ``folder``'s manifest, written atomically."""
    files = describe(folder, _all_files(folder) if names is None else sorted(names))
    return _dump(folder / MANIFEST, {"format": _FORMAT, "kind": kind, "lineage": lineage, "checksum": "crc32",
                                     "files": files})


def write_sidecar(data: Path, final: Path, kind: str) -> None:
    """The manifest of a single exported file, ``<final>.llmpar-manifest.json``, describing ``data`` (its staged
    copy) under ``final``'s name; written before the rename, so a crash leaves a file known to be ours."""
    info = describe(data.parent, [data.name])[data.name]
    _dump(sidecar_of(final), {"format": _FORMAT, "kind": kind, "lineage": None, "checksum": "crc32",
                              "files": {final.name: info}})


def sidecar_of(file: Path) -> Path:
    return file.with_name(f"{file.name}.{MANIFEST}")


def _dump(target: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    tmp = target.with_name(f".{target.name}.tmp")
    with open(tmp, "w") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, target)
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of ``folder`` (plain JSON, nothing executed), None if there is none or it is not ours."""
    return read_manifest_file(folder / MANIFEST)


def read_manifest_file(file: Path) -> dict[str, Any] | None:
    """A manifest file: inside a folder, or beside a single exported file (``<file>.llmpar-manifest.json``)."""
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT or not isinstance(manifest.get("files"), dict):
        return None
    return manifest if all(_inside(name) for name in manifest["files"]) else None


def _inside(name: Any) -> bool:
    """A relative path that stays inside its folder (no absolute path, no '..')."""
    return isinstance(name, str) and bool(name) and not os.path.isabs(name) and ".." not in Path(name).parts


def verify_manifest(folder: Path, manifest: dict[str, Any], *, checksums: bool = True) -> str | None:
    """Why ``folder`` does not match ``manifest`` (the first file, expected vs found), or None."""
    names = sorted(manifest["files"])
    for name in names:
        expected = manifest["files"][name]
        file = folder / name
        if _through_link(folder, name):
            return f"file {name} is reached through a symbolic link, which this library never writes"
        if not file.is_file():
            return f"file {name} is missing (expected {expected['size']} bytes)"
        size = file.stat().st_size
        if size != expected["size"]:
            return f"file {name} has {size} bytes, expected {expected['size']} ({'truncated' if size < expected['size'] else 'grown'})"
    if checksums:
        with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
            found = list(pool.map(lambda n: checksum(folder / n), names))
        for name, crc in zip(names, found):
            if crc != manifest["files"][name]["crc32"]:
                return f"file {name} has CRC-32 {crc}, expected {manifest['files'][name]['crc32']} (corrupted)"
    return None


def owned_files(folder: Path) -> set[str] | None:
    """Relative names of the files in ``folder`` this library wrote, from its manifest; for a DCP checkpoint written
    before manifests existed, its DCP files. None when ``folder`` holds nothing recognisably ours."""
    manifest = read_manifest(folder)
    if manifest is not None:
        return set(manifest["files"]) | {MANIFEST}
    legacy = {n for n in _all_files(folder) if _LEGACY.match(n)}
    return legacy if ".metadata" in legacy else None


def foreign_files(path: Path) -> list[str]:
    """Files under ``path`` (a folder or a file) that this library did not write: what replacing it would lose."""
    if not path.exists() and not path.is_symlink():
        return []
    if not path.is_dir():
        manifest = read_manifest_file(sidecar_of(path))
        return [] if manifest is not None and path.name in manifest["files"] else [str(path)]
    owned = owned_files(path) or set()
    return [n for n in _all_files(path) + ([MANIFEST] if (path / MANIFEST).exists() else []) if n not in owned]


def remove_owned(path: Path) -> list[str]:
    """Delete what this library wrote at ``path`` (its manifest's files, the manifest, folders left empty) and
    nothing else; returns the names of the files kept because something else wrote them."""
    if path.is_symlink():  # a link is not what this library writes: neither it nor what it leads to is removed
        return [str(path)]
    if not path.is_dir():
        sidecar = sidecar_of(path)
        if read_manifest_file(sidecar) is not None:
            path.unlink(missing_ok=True)
            sidecar.unlink(missing_ok=True)
            return []
        return [str(path)] if path.exists() else []
    owned = owned_files(path)
    if owned is None:
        kept = _all_files(path)
    else:
        # The manifest goes last: until then an interrupted removal can still be finished by calling this again.
        for name in sorted(owned - {MANIFEST}):
            if not _through_link(path, name):
                (path / name).unlink(missing_ok=True)
        (path / MANIFEST).unlink(missing_ok=True)
        kept = [n for n in _all_files(path) if n not in owned or _through_link(path, n)]
    for root, dirs, _ in os.walk(path, topdown=False):  # deepest first; linked folders are not entered
        for folder in (Path(root) / d for d in dirs if not os.path.islink(os.path.join(root, d))):
            if not any(folder.iterdir()):
                folder.rmdir()
    if not any(path.iterdir()):
        path.rmdir()
    if kept:
        warnings.warn(f"{path}: kept {len(kept)} file(s) this library did not write: {kept[:5]}.", stacklevel=2)
    return kept


def remove_tree(path: Path) -> None:
    """Remove one of this library's own staging folders (``.NAME.partial`` / ``.NAME.old``), which only it writes."""
    shutil.rmtree(path, ignore_errors=True)
