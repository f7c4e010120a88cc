"""Hugging Face checkpoints in and out at any layout.

In: ``LLMParallelStrategy(hf_checkpoint=DIR)`` loads a local model directory (config.json + safetensors) into
the transformers model inside the LightningModule after it is parallelized: each rank reads only the
slices it holds (safetensors slicing, memory-mapped), whatever splits them (tensor parallel, fused pieces,
ZeRO shards, pipeline stages). Checkpoints in transformers' legacy MoE layout (one tensor per expert) are
sliced per expert through transformers' own conversion mapping.

Out: :func:`save_hf_checkpoint` gathers the weights (named and laid out as one process has them) to rank 0,
which writes them with transformers' ``save_pretrained``, so ``AutoModelForCausalLM.from_pretrained`` loads
the directory in one process.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_llmpar.checkpointing.adapters import fold_adapters
from lightning_llmpar.checkpointing.conversions import Source, conversions, read, source_shape
from lightning_llmpar.checkpointing.dcp import prepare_staging
from lightning_llmpar.checkpointing.manifest import read_manifest, verify_manifest
from lightning_llmpar.checkpointing.publish import publish
from lightning_llmpar.modeling.materialize import pretrained_models
from lightning_llmpar.modeling.packing import Packing, canonical_regions, local_region, to_canonical
from lightning_llmpar.training.steps import ends_a_step

__all__ = ["HFCheckpointExport", "check_hf_directory", "hf_state_dict", "load_hf_checkpoint", "save_hf_checkpoint"]

# tie_word_embeddings: a tied model filled from an untied checkpoint would keep one of its two tensors.
_CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "n_embd", "n_layer", "n_head", "tie_word_embeddings")


def check_hf_directory(directory: str | Path) -> Path:
    """A local transformers model directory: config.json and at least one safetensors file."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ValueError(f"hf_checkpoint={str(directory)!r} is not a directory. Pass a local Hugging Face model folder"
                         " (config.json + *.safetensors), e.g. one written by save_pretrained.")
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        raise ValueError(f"hf_checkpoint={str(directory)!r} has no config.json or no *.safetensors file; write it with"
                         " save_pretrained(..., safe_serialization=True).")
    return path


def _single_model(module: nn.Module, exporting: bool = False) -> tuple[str, nn.Module]:
    found = pretrained_models(module)
    if len(found) != 1:
        what = (
            "save_hf_checkpoint exports the one transformers PreTrainedModel inside"
            if exporting else "hf_checkpoint loads into the one transformers PreTrainedModel inside"
        )
        fix = (
            " Other models (LitGPT's, your own): save with trainer.save_checkpoint and write one file with"
            " lightning_llmpar.export_consolidated." if exporting and not found else ""
        )
        raise ValueError(f"{what} {type(module).__name__}; found {len(found)} ({[n or type(m).__name__ for n, m in found]}).{fix}")
    return found[0]


class _Files:
    """Key -> file of a safetensors checkpoint (sharded with an index, or not), opened lazily.

    Never raises: what is wrong (an index naming a file outside the folder, a missing, truncated or unreadable
    shard) goes to ``problems``, which every rank agrees on before any of them raises (see fill_from_files).
    """

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.problems: list[str] = []
        self.where: dict[str, Path] = {}
        self._open: dict[Path, Any] = {}
        self._safe_open = safe_open
        index = path / "model.safetensors.index.json"
        try:
            if index.is_file():
                for key, name in json.loads(index.read_text())["weight_map"].items():
                    if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
                        self.problems.append(f"{index.name} names {name!r} for '{key}', a file outside {path}")
                    else:
                        self.where[key] = path / name
            else:
                for file in sorted(path.glob("*.safetensors")):
                    self.where.update({k: file for k in self._handle_of(file).keys()})  # noqa: SIM118
        except Exception as err:  # noqa: BLE001 - unreadable index or shard, reported on every rank
            self.problems.append(f"cannot read {index.name if index.is_file() else 'a shard'}: {type(err).__name__}: {err}")
        for file in sorted(set(self.where.values())):
            try:
                self._handle_of(file)
            except Exception as err:  # noqa: BLE001 - missing, truncated or not safetensors
                self.problems.append(f"shard {file.name} is missing, truncated or unreadable ({type(err).__name__}: {err})")
                self.where = {k: f for k, f in self.where.items() if f != file}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def read(self, key: str, region: tuple[slice, ...]) -> Tensor:
        return self._handle(key).get_slice(key)[region]

    def _handle(self, key: str) -> Any:
        return self._handle_of(self.where[key])

    def _handle_of(self, file: Path) -> Any:
        if file not in self._open:  # safe_open checks the header against the file's length (truncation)
            self._open[file] = self._safe_open(str(file), "pt")
        return self._open[file]


def _regions(tensor: Tensor, packing: Packing | None) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], Tensor]]:
    """(canonical offsets, sizes, local view) for every piece of this rank's data of ``tensor``."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if isinstance(tensor, DTensor):
        sizes, offsets = local_region(tensor)
    else:
        sizes, offsets = tuple(tensor.shape), (0,) * tensor.dim()
    for canon, size, start in canonical_regions(sizes, offsets, packing):
        view = local
        for d, (begin, length) in enumerate(zip(start, size)):
            view = view.narrow(d, begin, length)
        yield canon, size, view


def _hf_names(module: nn.Module, prefix: str, aliases: Mapping[str, str]) -> dict[str, str]:
    """Local parameter/persistent-buffer name -> the key transformers saves it under."""
    names: dict[str, str] = {}
    tensors = list(module.named_parameters(remove_duplicate=False))
    persistent = [(n, b) for n, b in module.named_buffers(remove_duplicate=False)
                  if n.rpartition(".")[2] not in getattr(module.get_submodule(n.rpartition(".")[0]), "_non_persistent_buffers_set", ())]
    for name, _ in tensors + persistent:
        canonical = aliases.get(name, name)
        if prefix and not canonical.startswith(prefix + "."):
            continue
        names[name] = canonical[len(prefix) + 1 :] if prefix else canonical
    return names


@torch.no_grad()
def load_hf_checkpoint(
    module: nn.Module, directory: str | Path, packings: Mapping[str, Packing] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Fill the transformers model inside ``module`` (already parallelized, on every rank) from ``directory``.

    Every rank checks every tensor it needs first; problems found anywhere are raised on every rank, so no
    rank is left waiting in a collective.
    """
    prefix, model = _single_model(module)
    # Nothing here may raise on one rank only: the others would wait in the agreement's collective.
    path = Path(directory).expanduser()
    try:
        check_hf_directory(directory)
        problems = _config_problems(model, path) + _manifest_problems(path) + _adapter_problems(model)
    except ValueError as err:
        problems = [str(err)]
    files = _Files(path)
    converted, skipped = conversions(model, files) if not problems else ({}, [])
    ignore = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    try:
        fill_from_files(module, prefix, files, problems, converted, _tied_targets(model), packings or {},
                        aliases or {}, ignore, f"hf_checkpoint={str(directory)!r} does not fit {type(model).__name__}")
    except ValueError as error:
        if not skipped:
            raise
        raise ValueError(
            f"{error} The checkpoint is saved in a layout transformers converts while loading ({'; '.join(skipped)}),"
            " which hf_checkpoint cannot read per rank. Load this model with from_pretrained in your LightningModule"
            " instead (each rank reads the whole checkpoint), or save it in the model's own layout first."
        ) from None


def fill_from_files(
    module: nn.Module,
    prefix: str,
    files: Any,
    problems: list[str],
    converted: Mapping[str, Source],
    tied: Mapping[str, str],
    packings: Mapping[str, Packing],
    aliases: Mapping[str, str],
    ignore: list[str],
    what: str,
) -> None:
    """Fill the parameters (and stored buffers) under ``prefix`` from a checkpoint's ``files`` (``where``, ``shape``,
    ``read``), each rank reading the canonical regions it holds; problems are agreed on by every rank first."""
    plan: list[tuple[Tensor, Source, Packing | None]] = []
    needed: set[str] = set()
    params = dict(module.named_parameters(remove_duplicate=False))
    problems += getattr(files, "problems", [])
    for name, key in _hf_names(module, prefix, aliases).items() if not getattr(files, "problems", []) else ():
        tensor = params[name] if name in params else module.get_buffer(name)
        file_key = key if key in files.where else tied.get(key, key)
        source = Source(key=file_key) if file_key in files.where else converted.get(key)
        if source is None:
            if name not in params:
                continue  # a buffer the checkpoint does not store keeps its initialized value
            problems.append(f"tensor '{key}' (parameter '{name}', shape {tuple(tensor.shape)}) is missing")
            continue
        needed.update(source.keys())  # even if unfit below: it belongs to a parameter, whatever its problem
        try:
            shape = source_shape(files, source)
        except Exception as err:  # noqa: BLE001 - an unreadable tensor, agreed on below like any other problem
            problems.append(f"tensor '{key}' cannot be read ({type(err).__name__}: {err})")
            continue
        if shape != tuple(tensor.shape):
            problems.append(f"tensor '{key}' has shape {shape} in the checkpoint but {tuple(tensor.shape)} in the model")
            continue
        plan.append((tensor, source, packings.get(name)))
    problems += _unexpected(files, needed, ignore)
    problems = _agree(problems)
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "") + ".")
    for tensor, source, packing in plan:
        for canon, size, view in _regions(tensor, packing):
            view.copy_(read(files, source, canon, size))


def _manifest_problems(path: Path) -> list[str]:
    """A folder written by save_hf_checkpoint must still hold its files at their sizes (checksums: too costly on
    every rank; a corrupted safetensors header is caught when opened)."""
    manifest = read_manifest(path)
    problem = verify_manifest(path, manifest, checksums=False) if manifest is not None else None
    return [problem] if problem else []


def _config_problems(model: nn.Module, path: Path) -> list[str]:
    try:
        theirs = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        return [f"config.json cannot be read ({type(err).__name__}: {err})"]
    ours = model.config.to_dict() if hasattr(model.config, "to_dict") else {}
    return [f"config.json has {f}={theirs[f]!r} but the model has {ours[f]!r}" for f in _CONFIG_FIELDS
            if f in theirs and f in ours and theirs[f] != ours[f]]


def _adapter_problems(model: nn.Module) -> list[str]:
    wrapped = [n for n, _ in model.named_parameters() if ".base_layer." in n or ".lora_" in n]
    return [f"the model holds peft adapters ({wrapped[0]}, ...), whose names no checkpoint has. Leave hf_checkpoint"
            " out and load the base model with from_pretrained in your LightningModule before get_peft_model (every"
            " rank then reads the whole checkpoint)"] if wrapped else []


def _tied_targets(model: nn.Module) -> dict[str, str]:
    """Tied parameter -> the key its values are saved under (transformers drops the tied copy)."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return {}
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return dict(keys) if isinstance(keys, Mapping) else {}


def _unexpected(files: Any, needed: set[str], ignore_patterns: list[str]) -> list[str]:
    gathered = [needed]
    if dist.is_available() and dist.is_initialized():
        gathered = [set() for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, needed)
    used = set().union(*gathered)
    ignore = [re.compile(p) for p in ignore_patterns]
    extra = sorted(k for k in files.where if k not in used and not any(p.search(k) for p in ignore))
    return [f"tensor '{k}' in the checkpoint belongs to no parameter of the model" for k in extra[:4]] + (
        [f"{len(extra) - 4} more unexpected tensors"] if len(extra) > 4 else [])


def _agree(problems: list[str]) -> list[str]:
    if not (dist.is_available() and dist.is_initialized()):
        return problems
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, problems)
    seen: dict[str, None] = {}
    for rank_problems in gathered:
        seen.update(dict.fromkeys(rank_problems))
    return list(seen)


# ---------------------------------------------------------------------------------------------- out


def hf_state_dict(module: nn.Module, packings: Mapping[str, Packing] | None = None,
                  aliases: Mapping[str, str] | None = None, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Full (gathered, canonical) tensors of the transformers model this rank's pipeline stage holds.

    Collective: every rank calls it; the ranks of one pipeline stage gather their shards together.
    """
    prefix, _ = _single_model(module)
    packings, aliases = packings or {}, aliases or {}
    params = dict(module.named_parameters(remove_duplicate=False))
    out: dict[str, Tensor] = {}
    for name, key in _hf_names(module, prefix, aliases).items():
        tensor = params[name] if name in params else module.get_buffer(name)
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if name in packings:
            full = to_canonical(full, packings[name])
        full = full.detach().to("cpu", dtype=dtype if dtype is not None and full.is_floating_point() else full.dtype)
        out.setdefault(key, full.clone())
    return out


def save_hf_checkpoint(trainer: Any, directory: str | Path, dtype: torch.dtype | str | None = None) -> Path:
    """Write the trained transformers model as a directory ``from_pretrained`` loads; call it on every rank.

    The weights are gathered to global rank 0 (host memory for one full copy), which writes them with the
    model's own ``save_pretrained`` into a staging folder put in place when complete: swapped in whole, or,
    into a folder holding other files (a tokenizer, a README), written beside them (see checkpointing.publish).
    """
    strategy = trainer.strategy
    module = trainer.lightning_module
    path = Path(directory).expanduser()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    prefix, model = _single_model(module, exporting=True)
    state = hf_state_dict(module, getattr(strategy, "packings", {}), getattr(strategy, "tied_aliases", {}), dtype)
    try:  # each rank its own pipeline stage's adapters; a refusal raised on every rank alike
        state, problems = fold_adapters(model, state), []
    except ValueError as err:
        problems = [str(err)]
    if problems := _agree(problems):
        raise ValueError(problems[0])
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if distributed:
        state = _gather_stages(strategy, state)
    if not distributed or dist.get_rank() == 0:
        for target, source in _tied_targets(model).items():
            if target in state and source in state and torch.equal(state[target], state[source]):
                del state[target]  # transformers ties it again on load
        staging = prepare_staging(path)
        dtypes = {t.dtype for t in state.values() if t.is_floating_point()}  # save_pretrained empties `state`
        model.save_pretrained(str(staging), state_dict=state, safe_serialization=True, is_main_process=True)
        _config_dtype_of_weights(staging, dtypes)
        refused = publish(staging, path, "hf")
    else:
        refused = None
    if distributed:
        shared = [refused]
        dist.broadcast_object_list(shared, src=0)  # every rank raises alike
        refused = shared[0]
    if refused is not None:
        raise ValueError(f"save_hf_checkpoint: {refused}")
    return path


def _gather_stages(strategy: Any, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every pipeline stage's tensors onto global rank 0 (sent by the stage's first data/tensor rank)."""
    mesh = getattr(strategy, "device_mesh", None)
    if mesh is None or mesh["pp"].size() == 1:
        return state
    coordinate = mesh.get_coordinate()
    if any(c != 0 for c in coordinate[1:]):  # not the first data/tensor-parallel rank of its stage
        return {}
    group = mesh["pp"].get_group()
    gathered: list[Any] | None = [None] * mesh["pp"].size() if dist.get_rank() == 0 else None
    dist.gather_object(state, gathered, dst=0, group=group)
    merged: dict[str, Tensor] = {}
    for part in gathered or []:
        for key, value in part.items():
            merged.setdefault(key, value)
    return merged


class HFCheckpointExport(Callback):
    """Export the transformers model inside the LightningModule with :func:`save_hf_checkpoint` at the end of
    training into ``<dirpath>/final`` (and every ``every_n_train_steps`` steps into ``<dirpath>/step=<n>``), from
    Python or YAML."""

    def __init__(self, dirpath: str, every_n_train_steps: int | None = None, dtype: str | None = None) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"HFCheckpointExport(every_n_train_steps={every_n_train_steps}) must be at least 1 or None.")
        if dtype is not None and getattr(torch, dtype, None) not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"HFCheckpointExport(dtype={dtype!r}): use 'float32', 'bfloat16' or 'float16'.")
        self.dirpath, self.every, self.dtype = dirpath, every_n_train_steps, dtype
        self.last: Path | None = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.every and step % self.every == 0 and ends_a_step(trainer):
            self.last = save_hf_checkpoint(trainer, Path(self.dirpath).expanduser() / f"step={step}", self.dtype)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # Beside the step exports, not over them.
        self.last = save_hf_checkpoint(trainer, Path(self.dirpath).expanduser() / "final", self.dtype)


def _config_dtype_of_weights(folder: Path, dtypes: set[torch.dtype]) -> None:
    """``config.json``'s dtype as the weights written (``dtypes``): transformers takes it from the model's (fp32
    masters here), so a bf16 export said float32 and ``from_pretrained(dtype="auto")`` loaded it in float32."""
    if len(dtypes) != 1 or not (file := folder / "config.json").is_file():
        return
    config, name = json.loads(file.read_text()), str(next(iter(dtypes))).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    if any(config.get(k) != name for k in keys):
        config.update(dict.fromkeys(keys, name))
        file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
