"""The part of Lightning's checkpoint dict that differs by rank, saved by every rank.

Lightning keeps what is not the module's or the optimizers' tensors (loops, callbacks' states, entries a module's
``on_save_checkpoint`` adds) from rank 0 only, which is right when every rank holds the same. Under sharding and
pipeline stages a callback's state may not: an EMA of the weights holds this rank's DTensor shards (ZeRO-3,
tensor parallel) or this stage's tensors only. Rank 0's copy handed to every rank restores the wrong values, or
none. So each such entry (a "unit": one callback's state, or one top-level entry) is compared across ranks at
save; those that differ go into one file per rank besides rank 0's ``meta.pt``, and each rank takes its own back
when the checkpoint is resumed on the layout it was saved with. On another layout a rank's shards cannot be
placed: units whose structure differs by rank (sharded tensors, a stage's own keys) are refused for the
callbacks that read them; units differing only in values fall back to rank 0's, as in Lightning, with a warning.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from lightning_llmpar.checkpointing.safe_read import safe_torch_load

__all__ = ["RANK_STATE", "holding", "rank_state_file", "restore_rank_state", "split_rank_state", "write_rank_state"]

RANK_STATE = "llmpar_rank_state"  # meta's record of the units saved per rank, and the layout they were saved on
_Key = tuple[str, ...]


def rank_state_file(rank: int) -> str:
    return f"rank_state{rank}.pt"


def _units(meta: Mapping[str, Any]) -> dict[_Key, Any]:
    units: dict[_Key, Any] = {(k,): v for k, v in meta.items() if k != "callbacks" and not k.startswith("llmpar_")}
    units |= {("callbacks", str(k)): v for k, v in (meta.get("callbacks") or {}).items()}
    return units


def _signature(value: Any) -> tuple[str, int, bool]:
    """(structure, checksum of the values, holds sharded tensors) of one unit."""
    parts: list[str] = []
    crc, sharded = 0, False

    def walk(v: Any, at: str) -> None:
        nonlocal crc, sharded
        if isinstance(v, DTensor):
            parts.append(f"{at}:dtensor{tuple(v.shape)}{v.dtype}{v.placements}")
            if any(not isinstance(p, Replicate) for p in v.placements):
                sharded = True  # this rank's own whatever its values: not read
                return
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            parts.append(f"{at}:{tuple(v.shape)}{v.dtype}{v.layout}")
            if v.layout == torch.strided and not v.is_nested and v.device.type != "meta":
                raw = v.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                crc = zlib.crc32(memoryview(raw.numpy()), crc)  # no copy of the bytes
            else:  # sparse, nested, meta: what torch.save makes of them
                buffer = io.BytesIO()
                torch.save(v.detach(), buffer)
                crc = zlib.crc32(buffer.getvalue(), crc)
        elif isinstance(v, Mapping):
            for k, item in v.items():
                walk(item, f"{at}/{k!r}")
        elif isinstance(v, (list, tuple)):
            parts.append(f"{at}[{len(v)}]")
            for i, item in enumerate(v):
                walk(item, f"{at}[{i}]")
        else:
            parts.append(at)
            crc = zlib.crc32(repr(v).encode(), crc)

    walk(value, "")
    return "|".join(parts), crc, sharded


def split_rank_state(
    meta: dict[str, Any], *, world_size: int, gather: Callable[[Any], list[Any]], holding: str
) -> dict[str, Any] | None:
    """Compare ``meta``'s units across ranks (``gather``: every rank's object, in rank order; a collective).
    Records in ``meta`` which differ, with structure or only values, and returns what this rank writes: its copies
    of them and ``holding`` (which parts of the model it holds, see :func:`holding`). None when every rank holds
    the same: nothing but rank 0's ``meta.pt`` is written. A unit some ranks lack is rank 0's, as in Lightning
    (``if trainer.is_global_zero: checkpoint["run_id"] = ...``), unless rank 0 lacks it (a pipeline stage's own).
    Units differing in structure leave ``meta.pt``, which would only hold rank 0's copy twice."""
    units = _units(meta)
    everyone: list[dict[_Key, tuple[str, int, bool]]] = gather({k: _signature(v) for k, v in units.items()})
    keys = sorted({k for signatures in everyone for k in signatures})
    structure, values = [], []
    for key in keys:
        first, *seen = [signatures.get(key) for signatures in everyone]
        seen = [s for s in seen if s is not None]
        if first is None or first[2] or any(s[2] or s[0] != first[0] for s in seen):
            structure.append(list(key))
        elif any(s[1] != first[1] for s in seen):
            values.append(list(key))
    if not structure and not values:
        return None
    meta[RANK_STATE] = {"world_size": world_size, "layout": meta.get("llmpar_layout"), "structure": structure,
                        "values": values}
    if any(k[0] == "callbacks" for k in structure):
        meta["callbacks"] = dict(meta["callbacks"])  # Lightning's own dict stays whole
    for key in structure:
        _drop(meta, tuple(key))
    return {"holding": holding, "units": [[k, units[tuple(k)]] for k in structure + values if tuple(k) in units]}


def holding(model: nn.Module) -> str:
    """Which parts of ``model`` this rank holds, and how: its parameters' names, local shapes and placements. Two
    runs whose ranks hold the same can exchange state that differs by rank; the layout's name alone does not say
    so (a pipeline schedule or its split points change which blocks a rank holds)."""
    parts = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        placed = p.placements if isinstance(p, DTensor) else ()
        parts.append(f"{name}:{tuple(local.shape)}:{placed}:{local.device.type == 'meta'}")
    return f"{zlib.crc32(chr(10).join(parts).encode()):08x}"


def write_rank_state(folder: Path, rank: int, own: Mapping[str, Any] | None) -> None:
    if own is not None:  # every rank writes one, also without units of its own
        torch.save(dict(own), folder / rank_state_file(rank))


def _put(meta: dict[str, Any], key: _Key, value: Any) -> None:
    if key[0] == "callbacks":
        meta.setdefault("callbacks", {})[key[1]] = value
    else:
        meta[key[0]] = value


def _drop(meta: dict[str, Any], key: _Key) -> None:
    if key[0] == "callbacks":
        (meta.get("callbacks") or {}).pop(key[1], None)
    else:
        meta.pop(key[0], None)


def _name(key: list[str]) -> str:
    return f"callback {key[1]}" if key[0] == "callbacks" else f"checkpoint entry {key[0]!r}"


def _on_mesh(value: Any, root: DeviceMesh) -> Any:
    """``value`` with its DTensors on ``root``'s sub-mesh of the same dimension names. An unpickled DTensor's mesh
    finds its process groups by their names, which are numbers in the order a process made its groups."""
    if isinstance(value, DTensor):
        names = value.device_mesh.mesh_dim_names
        try:
            live = root[names] if names else root
        except (KeyError, RuntimeError, ValueError):
            return value
        if not torch.equal(live.mesh, value.device_mesh.mesh):
            return value
        return DTensor.from_local(value.to_local(), live, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    if isinstance(value, dict):
        return {k: _on_mesh(v, root) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_on_mesh(v, root) for v in value)
    return value


def restore_rank_state(
    meta: dict[str, Any], folder: Path, *, rank: int, world_size: int, layout: str, attached: set[str],
    holds: str, agree: Callable[[bool], bool], mesh: DeviceMesh | None = None,
) -> str | None:
    """Put this rank's own units (see :func:`split_rank_state`) into ``meta``, loaded from ``folder``. On another
    layout: a ValueError for units differing in structure that a callback in ``attached`` (state keys) or the
    module reads; a warning to give for those differing only in values (rank 0's stay). Returns the warning.
    DTensors are put on ``mesh`` (the run's device mesh)."""
    saved = meta.pop(RANK_STATE, None)
    if saved is None:
        return None
    file = folder / rank_state_file(rank)
    mine = None
    if saved["world_size"] == world_size and saved["layout"] == layout and file.is_file():
        mine = safe_torch_load(file, map_location="cpu")
    if agree(mine is not None and mine["holding"] == holds):  # every rank holds what it held when saving
        for key in saved["structure"] + saved["values"]:  # rank 0's copies; a unit this rank lacked stays out
            _drop(meta, tuple(key))
        for key, value in mine["units"]:  # type: ignore[index]
            _put(meta, tuple(key), value if mesh is None else _on_mesh(value, mesh))
        return None
    read = [k for k in saved["structure"] if k[0] != "callbacks" or k[1] in attached]
    if read:
        now = (f"{layout} ({world_size} processes)" if saved["layout"] != layout or saved["world_size"] != world_size
               else f"{layout} too, but its ranks hold other parts of the model (another pipeline schedule, number"
               " of virtual stages or split)")
        raise ValueError(
            f"Checkpoint {folder} was saved on layout {saved['layout']} ({saved['world_size']} processes) and holds"
            f" state that differs by rank in its structure (sharded tensors, or a pipeline stage's own entries):"
            f" {', '.join(_name(k) for k in read)}. This run is {now}, where those shards have no place. Resume as"
            " it was saved; to change layouts, save that state whole (e.g. DTensor.full_tensor() gathered to every"
            " stage) or leave the callback out of the resumed run."
        )
    if saved["values"]:
        return (f"Checkpoint {folder} holds state that differs by rank in its values, saved on layout"
                f" {saved['layout']}: {', '.join(_name(k) for k in saved['values'])}. On this layout ({layout}) every"
                " rank is given rank 0's, as Lightning's own checkpoints do.")
    return None
