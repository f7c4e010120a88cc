"""Pipeline parallelism for a LightningModule on torch.distributed.pipelining.

The user's own ``training_step`` is the stage program. Each stage runs it on a microbatch with the
block stack narrowed to the stage's blocks: a non-first stage substitutes the activation it received
for the input of its first block, a non-last stage stops at the output of its last block, and the last
stage runs the step to the end, so the user's loss code is untouched. Modules holding parameters before
the stack (embeddings) live on the first stage, those after it (norm, head) on the last; parameter
names never change, so checkpoints move between layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmpar.modeling.structure import BlockStack, Stack, block_at, first_arg_name, num_params
from lightning_llmpar.modeling.ties import TiedWeight, split_copies
from lightning_llmpar.pipeline.stages import StageLayout
from lightning_llmpar.pipeline.window import meta_copy, narrow_blocks, output_form, widen_blocks

__all__ = [
    "split_model",
    "StageModule",
    "replace_module",
    "stage_finder",
    "stage_program",
    "outside_owners",
    "narrow_blocks",
    "widen_blocks",
    "output_form",
    "seeded_noise",
]

BATCH_KWARG = "llmpar_batch"


class StageBoundary(Exception):
    """Raised at the last block of a non-last stage to end the step there, carrying the activation."""

    def __init__(self, activation: Tensor) -> None:
        super().__init__("pipeline stage boundary")
        self.activation = activation.contiguous()  # sent point to point, which takes no views (Inkling's blocks)


def seeded_noise(shape: Any, seed: int, device: Any, dtype: torch.dtype) -> Tensor:
    """Standard normal values drawn on the host from ``seed`` alone: the same on every rank and run."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(device, dtype)


class _StandIn(nn.Module):
    """Takes the place of a module that lives on another stage.

    Before the stack it must still produce an output of the right shape (the model's forward uses it
    to build positions and masks; the stage then replaces it with the received activation), so it runs
    a copy of the module on the meta device and returns zeros of that shape. After the stack it is
    never reached, because the stage ends at its last block.
    """

    def __init__(
        self, original: nn.Module, name: str, before_stack: bool, blocks: Stack, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.name, self.before_stack, self.dtype = name, before_stack, dtype
        self.noise: int | None = None  # the split check's seed for random outputs instead of zeros
        self.num_embeddings = getattr(original, "num_embeddings", None)
        self._meta = [meta_copy(original)] if before_stack else []  # list: not a submodule
        self._blocks = [blocks]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self._blocks[0], "_llmpar_window", None) is None:  # not a stage's step: the model called directly
            raise RuntimeError(
                f"'{self.name}' is held by another pipeline rank: after the pipeline split this rank's model holds"
                " only its stages, so calling it outside a step (after fit, in a hook) cannot compute its output"
                " (before a first step, a later stage would have run on zeros). Let the pipeline run it:"
                " trainer.predict / trainer.validate with predict_step / validation_step; or, for the whole model in"
                " one process, trainer.save_checkpoint(path) then lightning_llmpar.export_consolidated(path, output)."
            )
        entered = getattr(self._blocks[0], "_llmpar_entered", False)
        if entered and self.before_stack and isinstance(self._meta[0], nn.Embedding):
            # An embedding after the blocks: the step calling the model again (an evaluation step's second forward,
            # greedy decoding; a training step's is caught when planned).
            raise ValueError(
                f"Pipeline split: module '{self.name}', placed on the first stage as running before the block stack,"
                " ran after the blocks had run: the step calls the model a second time (two inputs, or decoding"
                " token by token). A pipeline runs one forward per microbatch: concatenate the inputs into one batch,"
                " call the model once and split its output; decode with pipeline_parallel=1 or from an export. If"
                " instead the forward itself uses it after its blocks, see docs/model-convention.md."
            )
        if not self.before_stack or entered:
            where = ("first", "before") if self.before_stack else ("last", "after")
            again = (" Or the step calls the model a second time (two inputs, two forwards): a pipeline runs one"
                     " forward per microbatch, so concatenate the inputs into one batch, call the model once and"
                     " split its output.") if entered else ""
            raise ValueError(
                f"Pipeline split: module '{self.name}' was placed on the {where[0]} stage as running {where[1]} the"
                f" block stack, but the model calls it {'after' if entered else 'before'} its blocks (here, on a"
                f" stage that does not hold it). See docs/model-convention.md for what the split needs.{again}"
            )
        device = next((a.device for a in args if isinstance(a, Tensor)), torch.device("cpu"))
        to_meta = lambda t: t.to("meta") if isinstance(t, Tensor) else t  # noqa: E731
        out = self._meta[0](*[to_meta(a) for a in args], **{k: to_meta(v) for k, v in kwargs.items()})
        # Under a mixed-precision policy the real module computes with cast weights: match its output dtype
        # (code after it, such as rotary tables, takes its dtype from this output).
        dtype = self.dtype if self.dtype is not None and out.is_floating_point() else out.dtype
        if self.noise is not None and dtype.is_floating_point:
            return seeded_noise(out.shape, self.noise, device, dtype)
        return torch.zeros(out.shape, dtype=dtype, device=device)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if not self._meta:
                raise
        device = next((p.device for p in self._blocks[0].parameters()), torch.device("cpu"))
        return _reach(self._meta[0], name, device, self.dtype)


class _Reach:
    """A submodule of a module another stage holds, as the model reads it for a weight's dtype, device or shape
    (ViT reads ``embeddings.patch_embeddings.projection.weight.dtype``)."""

    def __init__(self, meta: nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
        self._meta, self._device, self._dtype = meta, device, dtype

    def __getattr__(self, name: str) -> Any:
        return _reach(self._meta, name, self._device, self._dtype)


def _reach(meta: nn.Module, name: str, device: torch.device, dtype: torch.dtype | None) -> Any:
    """Attribute ``name`` of the meta copy ``meta``: a weight as a zero-stride tensor of its shape on this stage's
    device, no memory (Llama 4 moves the input ids to the embedding's device), a submodule as a ``_Reach``, a
    setting (``padding_idx``) as it is. A buffer's values are not here (position ids read as zeros would be wrong):
    none is given."""
    value = getattr(meta, name)
    if isinstance(value, nn.Parameter):
        return torch.zeros((), dtype=dtype or value.dtype, device=device).expand(value.shape)
    if isinstance(value, Tensor):
        raise AttributeError(f"buffer '{name}' of a module another pipeline stage holds")
    return _Reach(value, device, dtype) if isinstance(value, nn.Module) else value


# Names of modules that run after the block stack even when registered before it (OPT's decoder
# registers final_layer_norm before its layers).
_AFTER_NAMES = {"lm_head", "ln_f", "norm_f", "final_layer_norm", "final_layernorm", "final_norm", "project_out",
                "embed_out", "output", "head"}


def _shipped_order(model: nn.Module, stack: BlockStack) -> tuple[set[str], set[str]]:
    """(before, after) the stack from transformers' ``base_model_pp_plan`` (modules in execution order)."""
    before: set[str] = set()
    after: set[str] = set()
    for prefix, module in model.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_pp_plan", None)
        if not plan or getattr(module, "base_model", None) is not module:
            continue
        names = [f"{prefix}.{key}" if prefix else key for key in plan]
        if stack.prefix in names:
            at = names.index(stack.prefix)
            before.update(names[:at])
            after.update(names[at + 1 :])
    return before, after


def outside_owners(model: nn.Module, stack: BlockStack) -> tuple[list[str], list[str]]:
    """Modules outside the stack that hold parameters: (run before it, run after it).

    What was seen in a run of the model's step decides (``stack.ran_after``, see pipeline_check). A module not
    seen running (its weight used directly) goes by registration order, unless the model says otherwise:
    transformers' ``base_model_pp_plan``, or a name that only a final norm or output head has. A wrong guess is
    caught at the first step (a stand-in called on the wrong side of the blocks raises).
    """
    shipped_before, shipped_after = _shipped_order(model, stack)
    before, after, seen_stack = [], [], False
    for name, module in model.named_modules():
        if name == stack.prefix:
            seen_stack = True
            continue
        if name.startswith(stack.prefix + ".") or not any(True for _ in module.parameters(recurse=False)):
            continue
        if any(name.startswith(owner + ".") for owner in before + after):
            continue  # moves with its parent
        leaf = name.rsplit(".", 1)[-1].lower()
        runs_after = seen_stack and name not in shipped_before
        if name in shipped_after or leaf in _AFTER_NAMES or leaf.startswith("final"):
            runs_after = True
        if name in stack.ran_before or name in stack.ran_after:
            runs_after = name in stack.ran_after
        (after if runs_after else before).append(name)
    return before, after


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def stage_program(
    module: nn.Module,
    blocks: Stack,
    window: tuple[int, int],
    last: bool,
    incoming: Tensor | None,
    stand_ins: dict[str, nn.Module],
    call: Callable[[], Any],
) -> tuple[bool, Any]:
    """Run ``call()`` (the user's step) as the stage holding blocks ``window``: modules of other stages replaced
    by ``stand_ins``, ``incoming`` substituted for the first block's input, the step cut after the window's last
    block unless ``last``. Returns (cut at the boundary, the activation there or the step's result)."""
    start, stop = window
    blocks._llmpar_window = tuple(range(start, stop))  # type: ignore[assignment]
    blocks._llmpar_entered = False  # type: ignore[assignment]
    originals = {name: module.get_submodule(name) for name in stand_ins}
    for name, stand_in in stand_ins.items():
        replace_module(module, name, stand_in)
    first = block_at(blocks, start)
    arg = first_arg_name(first)

    def enter(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        blocks._llmpar_entered = True  # type: ignore[assignment]
        if incoming is None:
            return args, kwargs
        if args:
            return (incoming, *args[1:]), kwargs
        return args, {**kwargs, arg: incoming}

    def boundary(_m: nn.Module, _args: Any, output: Any) -> None:
        raise StageBoundary(output[0] if isinstance(output, (tuple, list)) else output)

    handles = [first.register_forward_pre_hook(enter, with_kwargs=True)]
    if not last:
        handles.append(block_at(blocks, stop - 1).register_forward_hook(boundary))
    try:
        return False, call()
    except StageBoundary as done:
        return True, done.activation
    finally:
        for handle in handles:
            handle.remove()
        blocks._llmpar_window = None  # type: ignore[assignment]
        for name, original in originals.items():
            replace_module(module, name, original)


class StageModule(nn.Module):
    """One pipeline stage: owns its parts (for FSDP and PipelineStage) and runs the user's step."""

    def __init__(self, runner: Any, index: int, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        self.index = index
        self.parts = nn.ModuleDict({name.replace(".", "__"): m for name, m in parts.items()})
        self._runner = [runner]  # list: keeps the runner (and the LightningModule) out of the module tree

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        batch = kwargs.pop(BATCH_KWARG)
        incoming = args[0] if args else None
        return self._runner[0].run_stage(self.index, batch, incoming)


def stage_finder(model: nn.Module, stack: BlockStack, layout: StageLayout) -> Callable[[str], int]:
    """Maps a parameter name of the unsplit model to the stage that holds it."""
    before, after = outside_owners(model, stack)
    position = {key: i for i, key in enumerate(stack.keys())}
    block_stage = {i: s for s, (start, stop) in enumerate(layout.block_ranges) for i in range(start, stop)}

    def stage_of(name: str) -> int:
        module = name.rpartition(".")[0]
        if stack.prefix and module.startswith(stack.prefix + "."):
            return block_stage[position[module[len(stack.prefix) + 1 :].split(".", 1)[0]]]
        if any(module == o or module.startswith(o + ".") for o in before):
            return 0
        if any(module == o or module.startswith(o + ".") for o in after):
            return layout.num_stages - 1
        raise ValueError(f"Parameter '{name}' is neither in the block stack nor in a module before or after it.")

    return stage_of


def split_model(
    model: nn.Module,
    stack: BlockStack,
    layout: StageLayout,
    pp_rank: int,
    tied: Sequence[TiedWeight] = (),
    param_dtype: torch.dtype | None = None,
    replicate_before: bool = False,
) -> tuple[dict[int, dict[str, nn.Module]], dict[str, tuple[nn.Module, nn.Module]]]:
    """Remove from ``model`` what other pipeline ranks hold; return this rank's parts per stage.

    Also returns, for the modules before the stack that this rank keeps, a (real, stand-in) pair: the rank's later
    stages must run the stand-in, or they would use (and, under ZeRO-3, find resharded) the first stage's embedding.
    Tied weights used by several of this rank's stages get a copy per stage (see lightning_llmpar.modeling.ties).
    ``replicate_before``: the blocks read what the modules before the stack compute, so every rank (holding one
    stage) keeps them and runs them whole; their gradients are summed over the ranks (``TiedCopies``)."""
    before, after = outside_owners(model, stack)
    local = layout.stages_of(pp_rank)
    last = layout.num_stages - 1
    split_copies(model, tied, stage_finder(model, stack, layout), local)
    parts: dict[int, dict[str, nn.Module]] = {s: {} for s in local}
    blocks, keys = stack.blocks, stack.keys()
    for s in local:
        start, stop = layout.block_ranges[s]
        for i in range(start, stop):
            parts[s][f"{stack.prefix}.{keys[i]}"] = blocks._modules[keys[i]]
    swaps: dict[str, tuple[nn.Module, nn.Module]] = {}
    for name in before:
        if replicate_before:
            parts[local[0]][name] = model.get_submodule(name)
        elif 0 in local:
            parts[0][name] = real = model.get_submodule(name)
            swaps[name] = (real, _StandIn(real, name, True, blocks, param_dtype))
        else:
            replace_module(model, name, _StandIn(model.get_submodule(name), name, True, blocks, param_dtype))
    for name in after:
        if last in local:
            parts[last][name] = model.get_submodule(name)
        else:
            replace_module(model, name, _StandIn(model.get_submodule(name), name, False, blocks))
    keep = {keys[i] for s in local for i in range(*layout.block_ranges[s])}
    narrow_blocks(blocks, stack.forms)
    for key in list(blocks._modules):
        if key not in keep:
            del blocks._modules[key]
    return parts, swaps


def stage_costs(model: nn.Module, stack: BlockStack) -> tuple[list[int], int, int]:
    before, after = outside_owners(model, stack)
    costs = [num_params(b) for b in stack.modules()]
    first = sum(sum(p.numel() for p in model.get_submodule(n).parameters(recurse=False)) for n in before)
    last = sum(sum(p.numel() for p in model.get_submodule(n).parameters(recurse=False)) for n in after)
    return costs, first, last
