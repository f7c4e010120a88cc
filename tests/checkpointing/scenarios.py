"""What the ranks run in the checkpoint-safety tests: a small transformers Llama trained through the public API,
saving, exporting and resuming as a user would."""

from __future__ import annotations

import os
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_llmpar import HFCheckpointExport, LLMParallelStrategy, save_hf_checkpoint
from lightning_llmpar.fault_tolerance.callbacks import FaultTolerantCheckpoint
from tests.workloads import HFLlamaModule, TokenData

MARKER = "PAYLOAD_RAN"


class Payload:
    """Unpickling it creates a marker file: proof that a checkpoint file ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class _Steps(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.steps.append(trainer.global_step)
        self.losses.append(float(outputs["loss"]))


def train(
    *,
    steps: int,
    ftc: dict[str, Any] | None = None,
    hf_export: dict[str, Any] | None = None,
    ckpt_path: str | None = None,
    save_hf: str | None = None,
    save_ckpt: str | None = None,
    hf_checkpoint: str | dict[int, str] | None = None,
    strategy: dict[str, Any] | None = None,
    home: str | None = None,
    model_checkpoint: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fit the small Llama for ``steps`` (one process unless launched on more ranks); errors come back as text."""
    if home is not None:  # where '~' points in this rank
        os.environ["HOME"] = home
    seed_everything(0, verbose=False)
    rank = int(os.environ.get("RANK", "0"))
    if isinstance(hf_checkpoint, dict):  # a different folder per rank: what one rank alone sees
        hf_checkpoint = hf_checkpoint[rank]
    recorder = _Steps()
    callbacks: list[Callback] = [recorder]
    if ftc is not None:
        callbacks.append(FaultTolerantCheckpoint(**ftc))
    if hf_export is not None:
        callbacks.append(HFCheckpointExport(**hf_export))
    if model_checkpoint is not None:
        callbacks.append(ModelCheckpoint(**model_checkpoint))
    out: dict[str, Any] = {"error": None, "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            module = HFLlamaModule()
            trainer = Trainer(
                accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")),
                strategy=LLMParallelStrategy(hf_checkpoint=hf_checkpoint, **(strategy or {})), max_steps=steps,
                logger=False,
                enable_checkpointing=ftc is not None or model_checkpoint is not None, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks, use_distributed_sampler=False,
            )
            trainer.fit(module, datamodule=TokenData(4, n=64), ckpt_path=ckpt_path)
            if save_hf is not None:
                save_hf_checkpoint(trainer, save_hf)
            if save_ckpt is not None:
                trainer.save_checkpoint(save_ckpt)
        except Exception as err:  # noqa: BLE001 - the test reads the message
            out["error"] = f"{type(err).__name__}: {err}"
            out["traceback"] = traceback.format_exc()
    out["warnings"] = [str(w.message) for w in caught]
    out["steps"], out["losses"] = recorder.steps, recorder.losses
    return out


def save_pretrained_llama(directory: str, shards: bool = False) -> None:
    """The small Llama as a model folder a user downloads (config.json + safetensors), sharded if asked."""
    torch.manual_seed(7)
    HFLlamaModule().model.save_pretrained(directory, max_shard_size="20KB" if shards else "50GB")


def logits(directory: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(8).reshape(1, 8)).logits


# ------------------------------------------------------------------------------ a kill at each file operation

_FILE_OPS = [("os", "rename"), ("os", "replace"), ("os", "unlink"), ("os", "rmdir"), ("os", "mkdir"), ("os", "fsync"),
             ("shutil", "rmtree"), ("shutil", "copyfile"), ("io", "open"), ("builtins", "open"), ("torch", "save")]


def _count_file_operations(kill_at: int, counter: list[int]) -> None:
    """Wrap every file operation a save can make; at operation number ``kill_at`` the process dies on the spot."""
    import builtins
    import importlib
    import io
    import shutil

    del builtins, io, shutil  # imported so importlib returns the same modules
    for module_name, name in _FILE_OPS:
        module = importlib.import_module(module_name)
        original = getattr(module, name)

        def wrapped(*args: Any, __original: Any = original, __name: str = f"{module_name}.{name}", **kwargs: Any) -> Any:
            if __name.endswith("open") and "r" in str(args[1] if len(args) > 1 else kwargs.get("mode", "r")):
                return __original(*args, **kwargs)  # reads change nothing on disk
            counter[0] += 1
            if counter[0] == kill_at:
                os._exit(9)  # as kill -9: no cleanup, no flush
            return __original(*args, **kwargs)

        setattr(module, name, wrapped)


def tiny_state(version: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(version)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def save_version(path: str, version: int, kill_at: int = 0) -> int:
    """Save checkpoint ``version`` of a tiny model to ``path`` as the strategy does (atomic DCP write); with
    ``kill_at`` > 0 the process is killed at that file operation. Returns the number of file operations."""
    from lightning_llmpar.checkpointing import dcp

    model, opt = tiny_state(version)
    counter = [0]
    _count_file_operations(kill_at, counter)
    dcp.save_checkpoint(path, model, [opt], {"version": version}, is_rank_zero=True, barrier=lambda: None)
    return counter[0]


def resume_version(folder: str) -> dict[str, Any]:
    """What resume finds in ``folder``: the newest complete checkpoint and the version its weights are."""
    from lightning_llmpar.checkpointing import dcp
    from lightning_llmpar.fault_tolerance.callbacks import newest_complete_checkpoint

    found = newest_complete_checkpoint(Path(folder))
    if found is None:
        return {"found": None}
    model, opt = tiny_state(100)
    meta = dcp.load_checkpoint(found, model, [opt])
    versions = [v for v in (1, 2) if all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                             tiny_state(v)[0].state_dict().values()))]
    return {"found": found.name, "meta": meta["version"], "weights": versions}


def resume_each(folders: list[str], save_again: bool) -> list[dict[str, Any]]:
    """:func:`resume_version` of every folder; with ``save_again``, after saving version 2 into each again."""
    out = []
    for folder in folders:
        if save_again:
            from lightning_llmpar.checkpointing import dcp

            model, opt = tiny_state(2)
            dcp.save_checkpoint(Path(folder) / "step=5.ckpt", model, [opt], {"version": 2}, is_rank_zero=True,
                                barrier=lambda: None)
        out.append(resume_version(folder))
    return out
