"""Is a checkpoint folder complete, intact and plain data? Answered without running anything it holds.

Used by every path that reads a checkpoint: the resume scan (``ckpt_path="last"``), the strategy's load, the
consolidated export. A folder with a manifest must match it file by file (size and CRC-32); one written before
manifests existed is checked for DCP's own completeness (every shard present and long enough) and accepted with
a warning. Metadata and ``meta.pt`` are read with the safe readers, so a planted payload is reported, not run.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from lightning_llmpar.checkpointing.manifest import read_manifest, verify_manifest
from lightning_llmpar.checkpointing.safe_read import UnsafeCheckpointError, read_dcp_metadata, safe_torch_load

__all__ = ["META_FILE", "checkpoint_problem", "legacy_note"]

META_FILE = "meta.pt"  # everything Lightning keeps besides tensors: loops, callbacks, schedulers, hparams


def legacy_note(path: Path) -> str | None:
    """A warning for a checkpoint written without a manifest (before this library wrote them), else None."""
    if read_manifest(path) is not None:
        return None
    return (f"{path} has no manifest (written by an older version): its files were checked for presence and length,"
            " not for corruption.")


_BACKEND = {"dcp": "fsdp2", "deepspeed": "deepspeed"}  # the sharding backend that writes each checkpoint kind


def checkpoint_problem(path: Path, kind: str | None = None, trusted: bool = False) -> str | None:
    """Why ``path`` cannot be resumed from (which file, expected vs found), or None if it is complete and intact;
    with ``kind`` (a sharding backend's ``checkpoint_kind``), also when that backend did not write it. ``trusted``
    (``checkpoint_weights_only=False``): its small files may hold what torch's safe loader refuses (a numpy array
    in a callback's state), which the load will unpickle; they are checked for corruption only."""
    path = Path(path).expanduser()
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return ("it is a file, not a checkpoint folder this strategy wrote. A one-file checkpoint (Lightning's own"
                " .ckpt) cannot resume a parallel run: load its weights into the module before fit"
                " (LightningModule.load_from_checkpoint, or load_state_dict of its 'state_dict') and fit without ckpt_path")
    manifest = read_manifest(path)
    written = manifest.get("kind") if manifest is not None else ("deepspeed" if (path / "ckpt").is_dir() else "dcp")
    if kind is not None and written != kind:
        return (f"sharding_backend={_BACKEND.get(written, written)!r} wrote it ({written!r} files), and this run's"
                f" sharding_backend={_BACKEND.get(kind, kind)!r} cannot read them")
    if manifest is not None:
        problem = verify_manifest(path, manifest)
        if problem is not None:
            return problem
        strays = sorted(p.name for p in _own_named(path) if p.name not in manifest["files"])
        if strays:
            return (f"{', '.join(strays)} {'is' if len(strays) == 1 else 'are'} named like its own files but not in its"
                    " manifest (this library did not write them there); move them out of the folder")
        if manifest.get("kind") == "deepspeed":
            return None  # DeepSpeed's files are pickles only DeepSpeed reads, and only when trusted
    elif (path / "ckpt").is_dir():  # DeepSpeed backend, written before manifests
        return None if any((path / "ckpt").iterdir()) else "empty DeepSpeed checkpoint"
    if not (path / ".metadata").is_file() or not (path / META_FILE).is_file():
        return f"missing .metadata or {META_FILE} (written only when every rank finished)"
    try:
        metadata = read_dcp_metadata(path)
        needed: dict[str, int] = {}
        for item in (metadata.storage_data or {}).values():
            needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
        for name, size in needed.items():
            file = path / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                return f"not a checkpoint: its metadata names a file outside the folder ({name})"
            if not file.is_file() or file.stat().st_size < size:
                return f"shard {name} missing or truncated"
        with zipfile.ZipFile(path / META_FILE) as archive:  # torch.save's zip: its CRCs show corruption
            bad = archive.testzip()
        if bad is not None:
            return f"{META_FILE} is corrupt ({bad})"
        for extra in [] if trusted else [path / META_FILE, *_own_named(path)]:
            try:
                safe_torch_load(extra, map_location="cpu", mmap=True)
            except UnsafeCheckpointError:
                raise
            except Exception as err:  # noqa: BLE001 - a pickle of another kind, or garbage
                return f"{extra.name} is not a file torch.save wrote ({type(err).__name__}: {err})"
    except UnsafeCheckpointError as err:
        return f"not a checkpoint ({err})"
    except Exception as err:  # noqa: BLE001 - any unreadable part makes the checkpoint unusable
        return f"unreadable ({type(err).__name__}: {err})"
    return None


def _own_named(path: Path) -> list[Path]:
    """The small per-rank files a checkpoint of this library may hold (see rank_state, compression)."""
    return [*path.glob("compression_rank*.pt"), *path.glob("rank_state*.pt")]
