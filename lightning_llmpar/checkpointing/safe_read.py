"""Reading checkpoint files without running the code a pickle can carry.

DCP keeps its ``.metadata`` as a plain pickle (``FileSystemReader.read_metadata`` is ``pickle.load``) and its
default load planner unpickles non-tensor values with ``torch.load(weights_only=False)``: either runs whatever a
file dropped into a checkpoint folder holds. Here ``.metadata`` goes through an unpickler that builds only the
classes DCP writes (found by saving real FSDP2, tensor-parallel, pipeline and one-process checkpoints of this
library), non-tensor values through torch's safe loader, and every other file this library reads too.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpointError", "read_dcp_metadata", "safe_torch_load"]


class UnsafeCheckpointError(ValueError):
    """A checkpoint file names something other than the plain data a checkpoint holds."""


def _allowed() -> set[tuple[str, str]]:
    # Every global the .metadata of this library's checkpoints names (FSDP2, tensor parallel, pipeline, one
    # process, flattened optimizer state), and nothing that can do more than build plain data.
    names = {
        ("torch.distributed.checkpoint.metadata", n)
        for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                  "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    }
    names |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
              ("torch.serialization", "_get_layout")}  # a layout by its name: a table lookup
    # StorageMeta.checkpoint_id: the folder it was written to.
    names |= {("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
    # dtypes are pickled as attributes of torch (torch.float32).
    names |= {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    return names


_ALLOWED = _allowed()


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise UnsafeCheckpointError(f"it names {module}.{name}, which DCP metadata never holds")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("it holds a persistent reference, which DCP metadata never holds")


def read_dcp_metadata(path: str | Path) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint folder ``path``, built from the allowed classes only."""
    file = Path(path) / ".metadata"
    with open(file, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle).load()
        except UnsafeCheckpointError as err:
            raise UnsafeCheckpointError(f"{file} is not DCP metadata: {err}; it was not loaded.") from None
        except Exception as err:  # noqa: BLE001 - truncated or garbled pickles raise many kinds
            raise UnsafeCheckpointError(f"{file} is not readable DCP metadata ({type(err).__name__}: {err}).") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP metadata.")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_dcp_metadata` in place of its ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files are not something this library writes
            raise UnsafeCheckpointError(f"{self.path}: per-rank DCP metadata is not supported.")
        metadata = read_dcp_metadata(Path(str(self.path)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values (learning rates, steps) read by torch's safe loader."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"value '{read_item.dest_index.fqn}' of the checkpoint is not plain data ({str(err).splitlines()[0]});"
                " it was not loaded."
            ) from None
        # DefaultLoadPlanner.load_bytes with torch.load(weights_only=False) replaced by the load above.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# Besides what torch's safe loader allows: paths, which hyperparameters often hold (they cannot run code).
SAFE_GLOBALS = [pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath]


def safe_torch_load(file: str | Path, **kwargs: Any) -> Any:
    """``torch.load`` with torch's safe (weights-only) unpickler; a file holding anything else is a ValueError."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(file, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"{file} holds objects torch's safe loader does not allow ({str(err).splitlines()[0]}); it was not loaded."
        ) from None
