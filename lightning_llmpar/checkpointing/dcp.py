"""Distributed checkpoints (torch.distributed.checkpoint) that any layout can resume from.

Keys are the model's own parameter names and the optimizer state is flattened to those names, so
a checkpoint written by tp2 x dp2 loads into dp2, into one process, or into any other layout: DCP
reshards on load. A checkpoint is written into a hidden sibling folder and renamed into place once
every rank has finished, so a crash never leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import pathlib
import pickle
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_llmpar.modeling.packing import Packing, canonical_view, unwrap

__all__ = ["save_checkpoint", "write_atomically", "prepare_staging", "commit_staging", "write_distributed", "load_checkpoint", "is_checkpoint", "export_consolidated", "META_FILE"]

META_FILE = "meta.pt"  # everything Lightning keeps besides tensors: loops, callbacks, schedulers, hparams
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def is_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def _tensor_state(
    model: nn.Module, optimizers: Sequence[Optimizer], aliases: Mapping[str, str], packings: Mapping[str, Packing]
) -> dict[str, Any]:
    state: dict[str, Any] = {"model": _canonical(get_model_state_dict(model), packings, "")}
    for i, opt in enumerate(optimizers):
        optim = get_optimizer_state_dict(model, opt, options=_OPTIM_OPTIONS)
        state[f"optimizer_{i}"] = _rename_params(_canonical(optim, packings, "state."), aliases)
    return state


def _canonical(state: dict[str, Any], packings: Mapping[str, Packing], prefix: str) -> dict[str, Any]:
    """Fused parameters split per piece (and their optimizer state) as chunks of the model's own layout, so
    the checkpoint does not depend on the tensor-parallel degree (see tensor_parallel.packing)."""
    if not packings:
        return state
    out = dict(state)
    for key, value in state.items():
        if not isinstance(value, DTensor) or not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        packing = packings.get(name) or next((p for n, p in packings.items() if name.startswith(n + ".")), None)
        if packing is not None and value.dim() > packing.dim:
            out[key] = canonical_view(value, packing)
    return out


def _unwrap(state: dict[str, Any]) -> dict[str, Any]:
    return {k: unwrap(v) for k, v in state.items()}


def _rename_params(optim: dict[str, Any], renames: Mapping[str, str]) -> dict[str, Any]:
    """Flattened optimizer state ('state.<param>.<key>', 'param_groups.<param>.<key>') under other names.

    Copies of a tied weight on several pipeline stages store their (identical) state under the name
    one process gives the weight, so a checkpoint loads into any layout; a copy whose target name is
    already present is dropped.
    """
    if not renames:
        return optim
    out: dict[str, Any] = {}
    for key, value in optim.items():
        section, _, rest = key.partition(".")
        for old, new in renames.items():
            if rest.startswith(old + "."):
                key = f"{section}.{new}.{rest[len(old) + 1:]}"
                break
        out.setdefault(key, value)
    return out


def _restore_copies(optim: dict[str, Any], aliases: Mapping[str, str], local: set[str]) -> dict[str, Any]:
    """Inverse of ``_rename_params`` after loading: every local copy gets the state stored for its weight."""
    out = dict(optim)
    for alias, canonical in aliases.items():
        for key in list(optim):
            section, _, rest = key.partition(".")
            if rest.startswith(canonical + "."):
                value = optim[key]
                out[f"{section}.{alias}.{rest[len(canonical) + 1:]}"] = value.clone() if isinstance(value, torch.Tensor) else value
                if canonical not in local:
                    out.pop(key, None)
    return out


def prepare_staging(path: Path) -> Path:
    """Rank 0, before any rank writes: the hidden ``.<name>.partial`` folder a save of ``path`` is written into,
    with whatever an earlier interrupted save left there removed."""
    staging = path.with_name(f".{path.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    return staging


def commit_staging(staging: Path, path: Path) -> None:
    """Rank 0, once every rank has written into ``staging``: rename it into place as ``path``."""
    old = path.with_name(f".{path.name}.old")
    if path.exists():
        path.rename(old) if path.is_dir() else path.unlink()
    staging.rename(path)
    if old.exists():
        shutil.rmtree(old)


def write_atomically(
    path: str | Path, write: Callable[[Path], None], *, is_rank_zero: bool, barrier: Callable[[], None]
) -> Path:
    """Run ``write(staging_folder)`` on every rank; the result appears under ``path`` only once complete.

    Shared by every checkpoint format (DCP here, DeepSpeed's engine in its backend): a crash leaves at
    most a hidden ``.<name>.partial`` folder, never a half-written checkpoint under the final name.
    """
    path = Path(path)
    staging = prepare_staging(path) if is_rank_zero else path.with_name(f".{path.name}.partial")
    barrier()
    write(staging)
    barrier()
    if is_rank_zero:
        commit_staging(staging, path)
    barrier()
    return path


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    meta: dict[str, Any],
    *,
    is_rank_zero: bool,
    barrier: Callable[[], None],
) -> Path:
    """Write model + optimizer shards and ``meta`` (DCP), atomically."""
    return write_atomically(
        path,
        lambda staging: write_distributed(staging, model, optimizers, meta, is_rank_zero=is_rank_zero),
        is_rank_zero=is_rank_zero,
        barrier=barrier,
    )


def write_distributed(
    folder: Path,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    meta: dict[str, Any],
    *,
    is_rank_zero: bool,
    aliases: Mapping[str, str] | None = None,
    packings: Mapping[str, Packing] | None = None,
) -> None:
    """This rank's DCP shards, plus ``meta`` from rank 0, into ``folder``."""
    dcp.save(_tensor_state(model, optimizers, aliases or {}, packings or {}), checkpoint_id=folder)
    if is_rank_zero:
        torch.save(meta, folder / META_FILE)


# Besides what torch's safe loader allows: paths, which hyperparameters often hold (they cannot run code).
_SAFE_GLOBALS = [pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath]


def read_meta(path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Everything but the tensors. Unpickled with torch's safe loader unless ``weights_only=False`` is passed."""
    file = Path(path) / META_FILE
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(file, map_location="cpu", weights_only=True if weights_only is None else weights_only)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{file} holds objects torch's safe loader does not allow ({str(err).splitlines()[0]}). If you trust this"
            " checkpoint, load it with weights_only=False (e.g. trainer.fit(model, ckpt_path=..., weights_only=False))."
        ) from err


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    aliases: Mapping[str, str] | None = None,
    packings: Mapping[str, Packing] | None = None,
    *,
    weights_only: bool | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Load shards into ``model``/``optimizers`` in whatever layout they are now; return the meta dict.

    ``strict=False`` (a LightningModule's ``strict_loading``) loads what the checkpoint and the model share.
    Optimizer state is loaded only if the checkpoint has it (not one saved with ``save_weights_only``).
    """
    path = Path(path)
    if not is_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a complete llmpar checkpoint (a folder with '.metadata' and '{META_FILE}')."
        )
    meta = read_meta(path, weights_only)
    if not meta.get("llmpar_optimizer_state", True):
        optimizers = []
    aliases = aliases or {}
    state = _tensor_state(model, optimizers, aliases, packings or {})
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    set_model_state_dict(model, _unwrap(state["model"]), options=StateDictOptions(strict=strict))
    local = {name for name, _ in model.named_parameters()}
    for i, opt in enumerate(optimizers):
        optim = _restore_copies(_unwrap(state[f"optimizer_{i}"]), aliases, local)
        set_optimizer_state_dict(model, opt, optim, options=_OPTIM_OPTIONS)
    return meta


def export_consolidated(path: str | Path, output: str | Path) -> Path:
    """Gather the model weights of a checkpoint (DCP, or DeepSpeed's) into one ``torch.save`` file."""
    path, output = Path(path), Path(output)
    if (path / "ckpt").is_dir() and not (path / ".metadata").is_file():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        weights = dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag="ckpt"))
    else:
        metadata = FileSystemReader(path).read_metadata()
        state: dict[str, Any] = {"model": {}}
        for key, meta in metadata.state_dict_metadata.items():
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
                state["model"][key[len("model.") :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
        dcp.load(state, checkpoint_id=path, no_dist=True)
        weights = state["model"]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".partial")
    torch.save(weights, tmp)
    tmp.replace(output)
    return output
