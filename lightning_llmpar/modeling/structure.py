"""The model convention every technique relies on: a stack of blocks inside the model.

Most transformer LMs keep their layers in one ``nn.ModuleList`` (``model.layers``, ``transformer.h``,
``blocks``...); torchtitan's models and other training libraries keep them in an ``nn.ModuleDict`` keyed "0".."N-1"
and iterate its ``values()`` (a pipeline stage deletes entries, so parameter names stay the whole model's); minimal
GPTs put them in an ``nn.Sequential`` and call it whole. We find any of them by structure, not by name, so a model
written elsewhere fits unchanged. Blocks are addressed by position
(``block_at``) and named by their key (``stack_keys``), which is the same thing for a ModuleList.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "BlockStack", "block_at", "count_attr", "find_block_stack", "first_arg_name", "has_forward", "is_transformers",
    "mark_block_stack", "num_params", "stack_keys",
]

Stack = nn.ModuleList | nn.ModuleDict | nn.Sequential
STACKS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def count_attr(owner: object, attr: str) -> int | None:
    """``owner.attr`` if it is a count (an int, not a bool). transformers' per-layer configs (Gemma 4) raise on a
    global read of an attribute that varies by layer: the layers' own modules hold their counts."""
    try:
        value = getattr(owner, attr, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError, not an AttributeError
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class BlockStack:
    """Where the repeated blocks live: ``prefix`` is the ModuleList's (or ModuleDict's) qualified name."""

    prefix: str
    blocks: Stack
    # Modules outside the stack seen to run before / after its blocks in one run of the model's step
    # (empty: not observed; the pipeline split then goes by registration order and names).
    ran_before: frozenset[str] = frozenset()
    ran_after: frozenset[str] = frozenset()
    # Each block's output form in that run: () a tensor, else a tuple's items with None for its tensors.
    forms: tuple[tuple, ...] = ()

    def names(self) -> list[str]:
        # Keys, not positions: under pipeline parallelism a rank keeps only some blocks, under their
        # original indices.
        return [f"{self.prefix}.{key}" if self.prefix else key for key in self.blocks._modules]

    def modules(self) -> list[nn.Module]:
        return [m for m in self.blocks._modules.values() if m is not None]

    def keys(self) -> list[str]:
        """Every block's key in the whole model, in order (also on a pipeline rank that holds only some)."""
        return stack_keys(self.blocks)

    @property
    def total(self) -> int:
        """Number of blocks in the whole model (also on a pipeline rank that holds only some)."""
        return len(self.blocks)


def stack_keys(blocks: Stack) -> list[str]:
    """The keys of a stack's blocks in the whole model, in the order the forward runs them: "0".."N-1" for a
    ModuleList, the ModuleDict's own (in insertion order, which ``values()`` follows); a stack narrowed to a
    pipeline stage's blocks remembers the keys it had."""
    kept = getattr(blocks, "_llmpar_keys", None)
    if kept is not None:
        return list(kept)
    if isinstance(blocks, nn.ModuleList):
        return [str(i) for i in range(len(blocks))]
    return list(blocks._modules)  # a ModuleDict's keys; a Sequential's ("0".."N-1", or the names it was given)


def block_at(blocks: Stack, index: int) -> nn.Module:
    """The block at position ``index`` of the whole stack (KeyError where a pipeline rank does not hold it)."""
    return blocks._modules[stack_keys(blocks)[index]]  # type: ignore[return-value]


def has_forward(module: nn.Module) -> bool:
    """Whether the module is ever called: containers (ModuleList, ModuleDict) only hold other modules."""
    return type(module).forward is not nn.Module.forward


def first_arg_name(module: nn.Module) -> str:
    """Name of the first argument of ``module.forward`` (callers may pass it by keyword)."""
    params = [p for p in inspect.signature(module.forward).parameters.values() if p.kind != p.VAR_KEYWORD]
    return params[0].name if params else ""


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


MARK = "_llmpar_block_stack"  # set on the stack a user named with LLMParallelStrategy(block_stack=...)


def mark_block_stack(model: nn.Module, name: str) -> None:
    """Make ``name`` the block stack every technique uses, instead of the one found by structure."""
    try:
        stack = model.get_submodule(name)
    except AttributeError as err:
        raise ValueError(f"block_stack={name!r} names no module of {type(model).__name__}.") from err
    if not isinstance(stack, STACKS) or len(stack) == 0:
        what = "an empty " + type(stack).__name__ if isinstance(stack, STACKS) else "a " + type(stack).__name__
        raise ValueError(
            f"block_stack={name!r} is {what}; it must name the nn.ModuleList, nn.ModuleDict or nn.Sequential holding"
            " the model's blocks, e.g. 'model.layers'."
        )
    setattr(stack, MARK, True)


def _is_composite(module: nn.Module) -> bool:
    """A block-like module: it runs (has a forward) and is built of submodules, unlike a Linear or a norm."""
    return has_forward(module) and any(True for _ in module.children())


def _is_stack(module: nn.Module) -> bool:
    """A ModuleList that can be the block stack: children of one class (a plain transformer, containers included),
    or composite blocks of a few classes, each repeated (hybrid models interleave attention and state-space layers:
    Jamba). Requiring repeats keeps a list of distinct sub-models (an encoder and a decoder) from being taken for
    blocks: the lists inside them are. A ModuleDict (torchtitan's ``layers``) counts when its entries are composite
    blocks of that kind: dicts of single layers (peft's ``lora_A``, per-task heads) are not stacks. So does an
    ``nn.Sequential`` (an exact ``nn.Sequential``, not a subclass with its own forward): a chain of single layers (an
    MLP's ``Sequential(Linear, GELU, Linear)``) is not."""
    if not isinstance(module, STACKS) or len(module) == 0:
        return False
    if isinstance(module, nn.Sequential) and type(module).forward is not nn.Sequential.forward:
        return False
    children = list(module._modules.values())
    composite = all(child is not None and _is_composite(child) for child in children)
    if isinstance(module, (nn.ModuleDict, nn.Sequential)) and not composite:
        return False
    classes = {type(child) for child in children}
    if len(classes) == 1:
        return True
    return len(children) > len(classes) and composite


def find_block_stack(model: nn.Module) -> BlockStack | None:
    """The stack named by the user (``block_stack``), else the ModuleList, ModuleDict or Sequential of blocks
    (``_is_stack``) holding the most trained parameters, then the most parameters, or None if there is none.

    Trained first: a distillation module's frozen teacher is often larger than the student it trains, and a
    pipeline or tensor-parallel split of the teacher would leave the model being trained whole on every rank."""
    for name, module in model.named_modules():
        if getattr(module, MARK, False):
            return BlockStack(prefix=name, blocks=module)  # type: ignore[arg-type]
    best: tuple[tuple[int, int], str, Stack] | None = None
    for name, module in model.named_modules():
        if not _is_stack(module):
            continue
        size = (sum(p.numel() for p in module.parameters() if p.requires_grad), num_params(module))
        if size[1] > 0 and (best is None or size > best[0]):
            best = (size, name, module)  # type: ignore[assignment]
    if best is None:
        return None
    return BlockStack(prefix=best[1], blocks=best[2])


def is_transformers(obj: Any, class_name: str) -> bool:
    """Whether ``obj`` is an instance of transformers' ``class_name`` (``PreTrainedModel``, ``Cache``), without
    importing transformers."""
    return any(c.__module__.startswith("transformers.") and c.__name__ == class_name for c in type(obj).__mro__)
