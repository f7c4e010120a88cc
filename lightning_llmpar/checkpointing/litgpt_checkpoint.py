"""LitGPT checkpoints in at any layout: a directory with ``lit_model.pth`` (LitGPT's state dict) and
``model_config.yaml``, loaded into the LitGPT ``GPT`` inside the LightningModule after parallelization.

The state dict is opened memory-mapped (``torch.load(mmap=True, weights_only=True)``; nothing else is unpickled), so each rank reads only
the slices it holds, exactly as ``hf_checkpoint`` does for safetensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmpar.checkpointing.hf_checkpoint import fill_from_files
from lightning_llmpar.checkpointing.safe_read import safe_torch_load
from lightning_llmpar.modeling.packing import Packing

__all__ = ["check_litgpt_directory", "load_litgpt_checkpoint"]

# Every field of LitGPT's Config changes what the model computes (rope base, norm eps, softcapping, sliding window,
# experts per token...), except these: names, the context length the rope cache is built for, the vocabulary size
# before padding (the padded one is compared).
_IGNORED_FIELDS = ("name", "hf_config", "block_size", "vocab_size", "padding_multiple")


def check_litgpt_directory(directory: str | Path) -> Path:
    path = Path(directory).expanduser()
    if not (path / "lit_model.pth").is_file() or not (path / "model_config.yaml").is_file():
        raise ValueError(
            f"litgpt_checkpoint={str(directory)!r} is not a LitGPT checkpoint directory (lit_model.pth and"
            " model_config.yaml)."
        )
    return path


class _TorchFile:
    """A state dict file opened memory-mapped: only the regions read come into memory."""

    def __init__(self, file: Path) -> None:
        # Never raises: a missing, truncated or unsafe file is a problem every rank agrees on (see fill_from_files).
        self.problems: list[str] = []
        self.tensors: dict[str, Tensor] = {}
        try:
            state = safe_torch_load(file, map_location="cpu", mmap=True)
            tensors = state.get("model", state) if isinstance(state, dict) else state
            if not isinstance(tensors, dict) or not all(isinstance(t, Tensor) for t in tensors.values()):
                raise ValueError("it is not a state dict of tensors")
            self.tensors = tensors
        except Exception as err:  # noqa: BLE001 - reported on every rank alike
            self.problems.append(f"{file.name} is missing, truncated or unreadable ({type(err).__name__}: {err})")
        self.where = {k: file for k in self.tensors}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def read(self, key: str, region: tuple[slice, ...]) -> Tensor:
        return self.tensors[key][region]


def _litgpt_model(module: nn.Module) -> tuple[str, nn.Module]:
    from litgpt.model import GPT

    found = [(n, m) for n, m in module.named_modules() if isinstance(m, GPT)]
    if len(found) != 1:
        raise ValueError(f"litgpt_checkpoint loads into the one litgpt.model.GPT inside {type(module).__name__}; found {len(found)}.")
    return found[0]


def _same(yaml_value: Any, value: Any) -> bool:
    """A value read from YAML against the config's: tuples come back as lists, and YAML 1.1 reads "1e-5" as text."""
    if isinstance(value, tuple | list) and isinstance(yaml_value, list):
        return len(value) == len(yaml_value) and all(map(_same, yaml_value, value))
    if isinstance(value, float) and isinstance(yaml_value, str | int):
        try:
            return float(yaml_value) == value
        except ValueError:
            return False
    return yaml_value == value


@torch.no_grad()
def load_litgpt_checkpoint(
    module: nn.Module, directory: str | Path, packings: dict[str, Packing] | None = None, aliases: dict[str, str] | None = None
) -> None:
    """Fill the LitGPT model inside ``module`` (already parallelized) from ``directory``; collective."""
    import yaml

    prefix, model = _litgpt_model(module)
    path = Path(directory).expanduser()
    # Nothing here may raise on one rank only: the others would wait in the agreement's collective.
    try:
        check_litgpt_directory(directory)
        theirs: dict[str, Any] = yaml.safe_load((path / "model_config.yaml").read_text()) or {}
        ours = vars(model.config)
        problems = [f"model_config.yaml has {f}={theirs[f]!r} but the model has {ours[f]!r}" for f in ours
                    if f in theirs and f not in _IGNORED_FIELDS and not _same(theirs[f], ours[f])]
    except Exception as err:  # noqa: BLE001 - agreed on below
        problems = [str(err) if isinstance(err, ValueError) else f"model_config.yaml: {type(err).__name__}: {err}"]
    # LitGPT's rotary caches are buffers computed from the config, not stored.
    fill_from_files(module, prefix, _TorchFile(path / "lit_model.pth"), problems, {}, {}, packings or {}, aliases or {},
                    [], f"litgpt_checkpoint={str(directory)!r} does not fit {type(model).__name__}")
