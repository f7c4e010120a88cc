"""Distributed checkpoints (torch.distributed.checkpoint) that any layout can resume from.

Keys are the model's own parameter names and the optimizer state is flattened to those names, so
a checkpoint written by tp2 x dp2 loads into dp2, into one process, or into any other layout: DCP
reshards on load. A checkpoint is written into a hidden sibling folder and renamed into place once
every rank has finished, so a crash never leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
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

from lightning_llmpar.checkpointing.keys import check_model_keys
from lightning_llmpar.checkpointing.manifest import (
    foreign_files,
    read_manifest,
    remove_tree,
    verify_manifest,
    write_manifest,
    write_sidecar,
)
from lightning_llmpar.checkpointing.safe_read import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    read_dcp_metadata,
    safe_torch_load,
)
from lightning_llmpar.checkpointing.scan import META_FILE, checkpoint_problem, legacy_note
from lightning_llmpar.checkpointing.shared import check_shared_folder
from lightning_llmpar.modeling.packing import Packing, canonical_view, unwrap
from lightning_llmpar.pipeline.stage_state import own_state_reads

__all__ = [
    "META_FILE", "commit_staging", "export_consolidated", "is_checkpoint", "load_checkpoint", "prepare_staging",
    "recover", "replace_problem", "save_checkpoint", "staging_path", "write_atomically", "write_distributed",
]
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def is_checkpoint(path: str | Path) -> bool:
    path = Path(path).expanduser()
    return path.is_dir() and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def _tensor_state(
    model: nn.Module, optimizers: Sequence[Optimizer], aliases: Mapping[str, str], packings: Mapping[str, Packing]
) -> dict[str, Any]:
    with own_state_reads():  # a rank's part of a pipeline-split model, as meant
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


def staging_path(path: Path) -> Path:
    """The hidden folder a save of ``path`` is written into before its commit."""
    return path.with_name(f".{path.name}.partial")


def _old(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def _fsync_dir(folder: Path) -> None:
    # A rename is durable once its directory is: without this a power cut can undo a completed commit.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(folder: Path) -> bool:
    manifest = read_manifest(folder) if folder.is_dir() else None
    return manifest is not None and verify_manifest(folder, manifest) is None


def recover(path: str | Path) -> None:
    """Finish a save interrupted between its two renames: ``path`` is missing but its staging (new) or old (previous)
    copy is complete. Several ranks may call it at once: a rename is atomic, and the one that loses finds it done."""
    path = Path(path).expanduser()
    if path.exists():
        return
    for copy in (staging_path(path), _old(path)):
        if _complete(copy):
            try:
                os.rename(copy, path)
                _fsync_dir(path.parent)
            except OSError:
                pass  # another rank recovered it first
            return


def prepare_staging(path: Path) -> Path:
    """Rank 0, before a save to ``path``: recover ``path`` from an interrupted commit, remove stale ``.NAME.partial``
    and ``.NAME.old`` folders (names reserved for this library's saves), return the empty staging folder's path."""
    path = Path(path).expanduser()
    recover(path)
    staging, old = staging_path(path), _old(path)
    for stale in (staging, old):
        if stale.exists():
            remove_tree(stale)
    path.parent.mkdir(parents=True, exist_ok=True)
    return staging


def commit_staging(staging: Path, path: Path, *, kind: str = "dcp", lineage: str | None = None) -> None:
    """Rank 0, once every rank's files are in ``staging``: record them in its manifest, then swap it into place.

    At every instant ``path`` or a complete copy recoverable by :func:`recover` exists: the previous checkpoint
    moves to ``.NAME.old`` only after the staging folder is complete, and is removed only after the new one is in
    place. ``path`` is replaced only if it is this library's (see :func:`replace_problem`).
    """
    path = Path(path).expanduser()
    write_manifest(staging, kind, lineage)
    _fsync_dir(staging)
    old = _old(path)
    if path.is_dir():
        os.rename(path, old)
    elif path.exists():
        path.unlink()
    os.rename(staging, path)
    _fsync_dir(path.parent)
    if old.exists():
        remove_tree(old)


def verdict(path: Path, kind: str | None = None, trusted: bool = False) -> tuple[str | None, str | None]:
    """(why ``path`` cannot be loaded (by a backend writing ``kind``) or None, a warning for a checkpoint without
    manifest or None), after finishing an interrupted commit of it."""
    recover(path)
    return checkpoint_problem(path, kind, trusted), legacy_note(path)


def replace_problem(path: Path) -> str | None:
    """Why a save must not replace ``path`` (it holds files this library did not write), or None."""
    foreign = foreign_files(Path(path).expanduser())
    if not foreign:
        return None
    return (
        f"{path} holds files this library did not write ({', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''});"
        " saving a checkpoint there would delete them. Save to a new path, or move those files away."
    )


def write_atomically(
    path: str | Path,
    write: Callable[[Path], None],
    *,
    is_rank_zero: bool,
    barrier: Callable[[], None],
    broadcast: Callable[[Any], Any] | None = None,
    kind: str = "dcp",
    lineage: str | None = None,
    agree: Callable[[bool], bool] | None = None,  # all ranks' AND of a flag (the shared-folder check)
) -> Path:
    """Run ``write(staging_folder)`` on every rank; the result appears under ``path`` only once complete.

    Shared by every checkpoint format (DCP here, DeepSpeed's engine in its backend): a crash at any instant leaves
    the previous checkpoint or the new one, complete, under ``path`` or recoverable into it. A ``path`` holding
    files this library did not write is refused on every rank (``broadcast`` carries rank 0's verdict), as is one
    some rank cannot see (``checkpointing.shared``)."""
    path = Path(path).expanduser()
    problem = replace_problem(path) if is_rank_zero else None
    if broadcast is not None:
        problem = broadcast(problem)
    if problem is not None:
        raise ValueError(problem)
    if is_rank_zero:
        prepare_staging(path)
    barrier()
    staging = staging_path(path)
    check_shared_folder(staging, is_rank_zero=is_rank_zero, broadcast=broadcast, agree=agree)
    write(staging)
    barrier()
    if is_rank_zero:
        commit_staging(staging, path, kind=kind, lineage=lineage)
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


def read_meta(path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Everything but the tensors. Unpickled with torch's safe loader unless ``weights_only=False`` is passed."""
    file = Path(path) / META_FILE
    if weights_only is False:
        return torch.load(file, map_location="cpu", weights_only=False)
    try:
        return safe_torch_load(file, map_location="cpu")
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(
            f"{err} If you trust this checkpoint, load it with weights_only=False"
            " (LLMParallelStrategy(checkpoint_weights_only=False), or strategy.load_checkpoint(path, weights_only=False))."
        ) from None


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    aliases: Mapping[str, str] | None = None,
    packings: Mapping[str, Packing] | None = None,
    *,
    weights_only: bool | None = None,
    strict: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Load shards into ``model``/``optimizers`` in whatever layout they are now; return the meta dict.

    ``strict=False`` (a LightningModule's ``strict_loading``) loads what the checkpoint and the model share.
    Optimizer state is loaded only if the checkpoint has it (not one saved with ``save_weights_only``).
    ``verify`` checks the folder first (:func:`checkpoint_problem`); the strategy does that once on rank 0.
    """
    path = Path(path).expanduser()
    if verify:
        recover(path)
    if not is_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a complete llmpar checkpoint (a folder with '.metadata' and '{META_FILE}')."
        )
    problem = checkpoint_problem(path) if verify else None
    if problem is not None:
        raise ValueError(f"Checkpoint {path} cannot be loaded: {problem}.")
    meta = read_meta(path, weights_only)
    if not meta.get("llmpar_optimizer_state", True):
        optimizers = []
    aliases = aliases or {}
    state = _tensor_state(model, optimizers, aliases, packings or {})
    check_model_keys(path, read_dcp_metadata(path), state["model"], strict=strict)
    dcp.load(state, checkpoint_id=path, storage_reader=SafeFileSystemReader(path),
             planner=SafeLoadPlanner(allow_partial_load=not strict))
    with own_state_reads():
        set_model_state_dict(model, _unwrap(state["model"]), options=StateDictOptions(strict=strict))
        local = {name for name, _ in model.named_parameters()}
        for i, opt in enumerate(optimizers):
            optim = _restore_copies(_unwrap(state[f"optimizer_{i}"]), aliases, local)
            set_optimizer_state_dict(model, opt, optim, options=_OPTIM_OPTIONS)
    return meta


def export_consolidated(path: str | Path, output: str | Path, *, weights_only: bool | None = None) -> Path:
    """Gather the model weights of a checkpoint (DCP, or DeepSpeed's) into one ``torch.save`` file.

    The checkpoint is verified and read without unpickling anything but plain data; a DeepSpeed checkpoint (whose
    files only DeepSpeed's unpickling reads) needs ``weights_only=False``. ``output`` is replaced only if this
    function wrote it (a ``<output>.llmpar-manifest.json`` beside it records that).
    """
    path, output = Path(path).expanduser(), Path(output).expanduser()
    recover(path)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"Checkpoint {path} cannot be exported: {problem}.")
    foreign = foreign_files(output)
    if foreign:
        raise ValueError(f"export_consolidated: {output} exists and was not written by it; choose another output path"
                         " or move that file away.")
    if (path / "ckpt").is_dir() and not (path / ".metadata").is_file():
        if weights_only is not False:
            raise ValueError(_DEEPSPEED_TRUST.format(path=path, call="export_consolidated(path, output, weights_only=False)"))
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        weights = (dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag="ckpt"))
                   if any((path / "ckpt").glob("*optim_states.pt")) else {})
        # ZeRO-0 keeps no optimizer partitions, which zero_to_fp32 reads, and at ZeRO-1/2 it leaves frozen parameters
        # out: the module's own whole tensors (ZeRO-3 has no such file), read with the weights-only unpickler.
        if (whole := path / "ckpt" / "mp_rank_00_model_states.pt").is_file():
            module = safe_torch_load(whole, map_location="cpu")["module"]
            weights.update({k: v for k, v in module.items() if k not in weights})
    else:
        metadata = read_dcp_metadata(path)
        state: dict[str, Any] = {"model": {}}
        for key, meta in metadata.state_dict_metadata.items():
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
                state["model"][key[len("model.") :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
        dcp.load(state, checkpoint_id=path, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
                 no_dist=True)
        weights = state["model"]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.partial")
    torch.save(weights, tmp)
    write_sidecar(tmp, output, "consolidated")
    tmp.replace(output)
    return output


_DEEPSPEED_TRUST = (
    "{path} is a DeepSpeed checkpoint: DeepSpeed reads it by unpickling (torch.load(weights_only=False)), which runs"
    " any code its files hold. Load it only if you trust it, by passing weights_only=False: {call}."
)
