"""What a split model's state holds, said where a user reads it.

After the split a rank's module holds only its pipeline stages: the others' blocks are gone and the modules
before and after the stack that other ranks hold are parameterless stand-ins. Its ``state_dict()`` is that rank's
part, plain tensors without a word, so ``torch.save(module.state_dict())`` on rank 0 after ``fit`` saved half a
model (and ``load_state_dict(strict=False)`` loaded it into wrong logits). The strategy's own reads (checkpoints,
replicas, during a run) want exactly that part; a read outside a run that is not ours gets a warning naming what
is missing and how to get the whole model.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from lightning.pytorch.trainer.states import TrainerStatus
from torch import nn

__all__ = ["own_state_reads", "warn_on_partial_state_dicts"]

_OWN_READ: ContextVar[bool] = ContextVar("llmpar_own_state_read", default=False)


@contextmanager
def own_state_reads() -> Iterator[None]:
    """The strategy reads a rank's part of the model on purpose (a checkpoint writes each rank's part)."""
    token = _OWN_READ.set(True)
    try:
        yield
    finally:
        _OWN_READ.reset(token)


def warn_on_partial_state_dicts(module: nn.Module, whole: list[str]) -> None:
    """Warn once when ``module.state_dict()`` is taken outside a run and outside the strategy's own reads, after the
    split left this rank part of ``whole`` (the model's state dict keys before it)."""
    warned = []

    def hook(root: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
        trainer = getattr(root, "_trainer", None)
        running = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        if warned or running or _OWN_READ.get() or prefix:
            return
        missing = [k for k in whole if k not in state]
        if not missing:
            return
        warned.append(True)
        warnings.warn(
            f"LLMParallelStrategy: under pipeline parallelism this rank holds only its pipeline stages, so"
            f" state_dict() has {len(whole) - len(missing)} of the model's {len(whole)} entries ({missing[0]!r} and"
            f" {len(missing) - 1} more are on other ranks). For the whole model, save a checkpoint"
            " (trainer.save_checkpoint(path)) and gather it with lightning_llmpar.export_consolidated(path, output),"
            " or export a transformers model with lightning_llmpar.save_hf_checkpoint(trainer, directory).",
            stacklevel=3,
        )

    module.register_state_dict_post_hook(hook)
