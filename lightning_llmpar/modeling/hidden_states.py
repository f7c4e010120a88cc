"""transformers' ``output_hidden_states=True`` under layouts that cut what the blocks return.

A step may read a block's output (``outputs.hidden_states[i]``: a distillation or regularization term on an
intermediate layer). Under sequence parallelism each block's output is this rank's part of the sequence, and
transformers records it as it is: a loss on it trained silently wrong. The base model's output gets those entries
gathered along the sequence (differentiably, one all-gather each, only in steps that ask for them). Under pipeline
parallelism the last stage records only its own blocks' inputs and the final state, so ``hidden_states[1]`` was a
later layer's: the tuple is given its one-process length, entries of earlier stages refusing to be read.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_llmpar.modeling.structure import is_transformers

__all__ = ["EarlierStageState", "StageHiddenStates", "apply_hidden_states_gather", "apply_stage_hidden_states"]


def _models(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if is_transformers(m, "PreTrainedModel")]


def _recorded(output: Any) -> tuple | None:
    """The hidden states a transformers model's output recorded (None: none), or those a pipeline stage holds."""
    states = getattr(output, "hidden_states", None) if not isinstance(output, tuple) else None
    if isinstance(states, StageHiddenStates):
        return states.held()
    if not isinstance(states, tuple) or not states:
        return None
    return states if all(isinstance(s, Tensor) for s in states) else None


def apply_hidden_states_gather(module: nn.Module, mesh: DeviceMesh) -> None:
    """Under sequence parallelism over ``mesh`` (the tensor-parallel ranks): recorded hidden states whole. As a
    DTensor's full_tensor: a term on one is the same on every rank, so its gradient goes back as this rank's part
    (not summed over the ranks, as a plain all-gather's would be)."""
    degree = mesh.size()

    def gather(_: nn.Module, __: Any, output: Any) -> Any:
        states = _recorded(output)
        if states is None or states[-1].dim() < 3:
            return output
        length = states[-1].shape[1]  # the final state is whole (gathered for the head)
        whole = tuple(DTensor.from_local(s, mesh, [Shard(1)], run_check=False).full_tensor()
                      if s.dim() >= 3 and s.shape[1] * degree == length and s.shape[1] != length else s for s in states)
        placed = output.hidden_states  # (a pipeline stage's, placed at their indices: placed again)
        output.hidden_states = StageHiddenStates(whole, placed.first) if isinstance(placed, StageHiddenStates) else whole
        return output

    for model in _models(module):
        model.register_forward_hook(gather)


class EarlierStageState(ValueError):
    """State of blocks on an earlier pipeline stage read on the last (a hidden state, the example GPT's MoE
    load-balancing losses): the message says what the stage lacks, so the pipeline's split check passes it on as is."""


class StageHiddenStates(tuple):
    """The hidden states as one process records them (its length, each at its index), on the pipeline's last stage:
    entries from blocks on earlier stages refuse to be read by index (iterating gives None for them, as code that
    walks outputs does: Lightning's, the pipeline's merge of microbatch outputs)."""

    first: int = 0

    def __new__(cls, recorded: Any, first: int | None = None) -> StageHiddenStates:
        items = tuple(recorded)
        if first is None:  # rebuilt from its own items (a walk over the outputs): its leading Nones
            first = next((i for i, s in enumerate(items) if s is not None), len(items))
            items = items[first:]
        states = super().__new__(cls, (None,) * first + items)
        states.first = first
        return states

    def held(self) -> tuple:
        """The entries this stage holds, from index ``first`` on."""
        return tuple(tuple.__iter__(self))[self.first :]

    def __getitem__(self, index: Any) -> Any:
        picked = super().__getitem__(index)
        if picked is None or (isinstance(picked, tuple) and any(s is None for s in picked)):
            raise EarlierStageState(
                f"outputs.hidden_states[{index}]: under pipeline parallelism the stage that computes the loss holds"
                f" blocks {self.first} on, so it has hidden states {self.first} to {len(self) - 1} (the last is the"
                " final one) and not the earlier blocks' outputs. Read those, or use pipeline_parallel=1 (tensor"
                " parallelism and ZeRO give every hidden state)."
            )
        return picked


def apply_stage_hidden_states(module: nn.Module, blocks: nn.Module) -> None:
    """Under pipeline parallelism over ``blocks`` (the stack the stages split): where a stage's window starts after
    the first block, the hidden states at their one-process indices (transformers records none for the pass-throughs
    before the window; a forward that records what each block gets records the stage's input for them)."""

    def place(_: nn.Module, __: Any, output: Any) -> Any:
        states, window = _recorded(output), getattr(blocks, "_llmpar_window", None)
        placed = isinstance(getattr(output, "hidden_states", None), StageHiddenStates)
        if states is None or placed or not window or window[0] == 0 or len(states) < len(blocks) - window[0] + 1:
            return output
        output.hidden_states = StageHiddenStates(states[-(len(blocks) - window[0] + 1):], window[0])
        return output

    for model in _models(module):
        model.register_forward_hook(place)
