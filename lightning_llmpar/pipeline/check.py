"""Prove a pipeline split before training: the staged program must compute what the model's own forward does.

The split rests on assumptions about the model's forward (it calls the blocks in order, each taking the
previous one's output; what runs outside the stack before the blocks only feeds the first one). A forward that
breaks them trains silently wrong, or fails inside the schedule. So, before anything is split, the user's own
step runs once whole and once stage by stage (every stage of the pipeline, in this process, on one sample of
the first training batch, in eval mode so dropout draws nothing), and every stage's output is compared with
the block output it stands for. A stage that differs, or whose output does not depend on its input, is
refused with a ValueError naming the stage and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_llmpar.modeling.hidden_states import EarlierStageState
from lightning_llmpar.modeling.materialize import has_meta_tensors, materialize
from lightning_llmpar.modeling.structure import BlockStack
from lightning_llmpar.modeling.ties import find_tied_weights, retie
from lightning_llmpar.pipeline.split import _StandIn, outside_owners, seeded_noise, stage_program
from lightning_llmpar.pipeline.window import narrow_blocks, output_form, widen_blocks
from lightning_llmpar.training.ignore_index import IGNORE_INDEX
from lightning_llmpar.training.loss_normalization import batch_targets
from lightning_llmpar.training.quiet import quiet_step

__all__ = ["Reference", "check_split", "checkable", "first_sample", "run_whole"]

log = logging.getLogger(__name__)

# A model built on the meta device is checked on a random copy made in host memory, up to this size.
CHECK_COPY_BYTES = 2 * 2**30


@contextlib.contextmanager
def checkable(module: nn.Module) -> Iterator[bool]:
    """Yield whether ``module`` holds values to run the check on. A model on the meta device gets random values
    in host memory for the check (when it is small enough) and goes back to the meta device afterwards."""
    if not has_meta_tensors(module):
        yield True
        return
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    if size > CHECK_COPY_BYTES:
        log.info("pipeline split not checked before training: the model is on the meta device and %d bytes", size)
        yield False
        return
    tied = find_tied_weights(module)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        materialize(module, torch.device("cpu"), tied)
    try:
        yield all(bool(torch.isfinite(p).all()) for p in module.parameters() if p.is_floating_point())
    finally:
        # nn.Module.to, not Lightning's override: the module's recorded device stays what it was.
        nn.Module.to(module, "meta")
        retie(module, tied)  # leaving the CPU gives every name its own tensor again


def _first_tensor(value: Any) -> Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


def _loss(out: Any) -> Tensor:
    return out["loss"] if isinstance(out, dict) else out


def _close(a: Tensor, b: Tensor) -> bool:
    # NaN where the whole model has NaN too: a sample whose labels are all ignored has a NaN mean loss (0/0).
    return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5, equal_nan=True))


def first_sample(trainer: Any) -> Any:
    """One sample of the training data as a batch of one, for the pipeline split check. Read from the dataset
    directly: iterating the loader would move its sampler (a resumed run's position) and random state."""
    from torch.utils.data import DataLoader, IterableDataset
    from torch.utils.data.dataloader import default_collate

    try:
        loader = trainer.fit_loop._data_source.dataloader()
        dataset = loader.dataset if isinstance(loader, DataLoader) else None
        if dataset is None or isinstance(dataset, IterableDataset) or len(dataset) == 0:  # type: ignore[arg-type]
            raise TypeError("not one map-style dataset")
        with torch.random.fork_rng(devices=[]):
            def sample(i: int) -> Any:
                if loader.batch_sampler is None:
                    # batch_size=None: each item is a batch already (collate_fn only converts it); its first sample.
                    batch = loader.collate_fn(dataset[i]) if loader.collate_fn else dataset[i]
                    return tree_map(lambda x: x[:1] if isinstance(x, Tensor) and x.ndim else x, batch)
                return (loader.collate_fn or default_collate)([dataset[i]])

            # A sample whose labels are all ignored has a NaN loss (0/0) and NaN gradients: nothing to compare.
            for i in range(min(len(dataset), 64)):  # type: ignore[arg-type]
                if not _all_ignored(batch := sample(i)):
                    return batch
            return sample(0)
    except Exception as err:  # noqa: BLE001 - the check is optional; the first step checks what it can
        log.info("pipeline split not checked before training (no sample at hand: %s)", err)
        return None


def _all_ignored(batch: Any) -> bool:
    """Whether a batch's integer targets (``batch_targets``, unshifted) are all -100, the ignore index."""
    labels = batch_targets(batch, shifted=False)
    return isinstance(labels, Tensor) and not labels.is_floating_point() and bool((labels == IGNORE_INDEX).all())


def refuse_manual_optimization(module: Any) -> None:
    """Manual optimization, switched on in ``__init__`` or in ``configure_optimizers``, cannot run under pp."""
    if not module.automatic_optimization:
        raise ValueError(
            "pipeline_parallel > 1 runs forward and backward inside the pipeline schedule, so manual optimization"
            f" (automatic_optimization=False in {type(module).__name__}) cannot call manual_backward. Use automatic"
            " optimization, or pipeline_parallel=1."
        )


def step_on_one_sample(trainer: Any, strategy: Any) -> Callable[[], Any] | None:
    """The user's training step on one sample of the first training batch (for the split check), or None."""
    batch = first_sample(trainer)
    if batch is None:
        return None
    module = trainer.lightning_module
    optimizers: list[Any] = []

    def step() -> Any:
        # The user's step runs a few extra times here; ``trainer.strategy.checking_pipeline_split`` lets it skip
        # side effects of its own (counters, files).
        strategy.checking_pipeline_split = True
        if not optimizers:
            optimizers.append(_whole_model_optimizers(module))
            refuse_manual_optimization(module)  # configure_optimizers may have switched it on
        try:
            with _optimizers_set(strategy, *optimizers[0]):
                return module.training_step(batch, 0)
        finally:
            strategy.checking_pipeline_split = False

    return step


def _whole_model_optimizers(module: Any) -> tuple[list[Any], list[Any]]:
    """The module's optimizers and schedulers over the unsplit model, for a step that reads them (a learning rate
    logged from ``training_step``): the check runs before the split model's are made. None where they cannot be
    made yet (a fused kernel refuses parameters on the meta device): the step then sees none, as before."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    try:
        return _init_optimizers_and_lr_schedulers(module)[:2]
    except Exception:  # noqa: BLE001 - the check only lends them; the run makes its own after the split
        return [], []


@contextlib.contextmanager
def _optimizers_set(strategy: Any, optimizers: list[Any], schedulers: list[Any]) -> Iterator[None]:
    if strategy.optimizers or not optimizers:
        yield
        return
    strategy.optimizers, strategy.lr_scheduler_configs = optimizers, schedulers
    try:
        yield
    finally:
        strategy.optimizers, strategy.lr_scheduler_configs = [], []


@dataclass(frozen=True)
class Reference:
    """One run of the user's step on the whole model: its loss, every block's output, and the stack annotated
    with which outside modules ran before and after the blocks."""

    stack: BlockStack
    loss: Tensor
    outputs: dict[int, Tensor]
    calls: tuple[int, ...] = ()  # the blocks in the order the forward called them


@torch.no_grad()
def run_whole(module: nn.Module, stack: BlockStack, step: Callable[[], Any]) -> Reference:
    """Run ``step`` once on the unsplit model (eval mode), recording block outputs and the execution order."""
    blocks = stack.blocks
    outputs: dict[int, Tensor] = {}
    forms: dict[int, tuple] = {}
    entered = [False]
    before: set[str] = set()
    after: set[str] = set()

    def record(index: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any, output: Any) -> None:
            outputs.setdefault(index, _first_tensor(output))
            forms.setdefault(index, output_form(output))

        return hook

    calls: list[int] = []

    def enter(index: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any) -> None:
            entered[0] = True
            calls.append(index)

        return hook

    def called(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any) -> None:
            if name not in before and name not in after:
                (after if entered[0] else before).add(name)

        return hook

    hooks = [b.register_forward_hook(record(i)) for i, b in enumerate(stack.modules())]
    hooks += [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(stack.modules())]
    for name, sub in module.named_modules():
        inside = name == stack.prefix or name.startswith(stack.prefix + ".")
        if not inside and any(True for _ in sub.parameters(recurse=False)):
            hooks.append(sub.register_forward_pre_hook(called(name)))
    was_training = module.training
    module.eval()
    try:
        with quiet_step(module):
            loss = _loss(step())
    finally:
        for h in hooks:
            h.remove()
        module.train(was_training)
    seen = tuple(forms.get(i, ()) for i in range(len(blocks))) if len(forms) == len(blocks) else ()
    annotated = dataclasses.replace(stack, ran_before=frozenset(before), ran_after=frozenset(after), forms=seen)
    return Reference(annotated, loss, outputs, tuple(calls))


@torch.no_grad()
def check_split(
    module: nn.Module, reference: Reference, ranges: Sequence[tuple[int, int]], step: Callable[[], Any]
) -> bool:
    """Raise a ValueError if running ``step`` stage by stage (``ranges``: blocks per stage) differs from the
    ``reference`` run of it whole. ``module`` is the unsplit model; it is left as it was. Returns whether the
    modules before the stack must run on every stage: the blocks read values they compute besides the first
    block's input (Gemma 3n's and Gemma 4's per-layer inputs, Zamba's embeddings)."""
    stack, outputs = reference.stack, reference.outputs
    replicate = False
    _check_calls(stack, reference.calls)
    before, after = outside_owners(module, stack)
    blocks = stack.blocks
    was_training = module.training
    module.eval()
    original_class = type(blocks)
    try:
        reference_loss = reference.loss
        narrow_blocks(blocks, stack.forms)
        incoming: Tensor | None = None
        last = len(ranges) - 1
        for s, (start, stop) in enumerate(ranges):
            stand_ins: dict[str, nn.Module] = {}
            if s > 0 and not replicate:
                stand_ins.update({n: _StandIn(module.get_submodule(n), n, True, blocks) for n in before})
            if s < last:
                stand_ins.update({n: _StandIn(module.get_submodule(n), n, False, blocks) for n in after})

            def run(
                value: Tensor | None, start: int = start, stop: int = stop, s: int = s, stand_ins: dict = stand_ins
            ) -> tuple[bool, Any]:
                with quiet_step(module):
                    return stage_program(module, blocks, (start, stop), s == last, value, stand_ins, step)

            where = f"stage {s} (blocks {start}..{stop - 1} of '{stack.prefix}')"
            if s > 0 and before and not replicate and incoming is not None:
                trainable = [p for p in module.parameters() if p.requires_grad]
                if _reads_before(stand_ins, lambda run=run, x=incoming, t=trainable, end=s == last: _sensitivities(run, x, end, t)):
                    # The stage needs what the modules before the stack compute: they run on every stage (the
                    # split below then runs them whole, and must still give the whole model's values).
                    replicate = True
                    for n in before:
                        del stand_ins[n]
            try:
                cut, value = run(incoming)
            except EarlierStageState:  # says itself what the stage lacks
                raise
            except Exception as error:  # the whole step ran: only the cut makes it fail
                raise ValueError(
                    f"Pipeline split: {where} fails when run on its own ({type(error).__name__}: {error}). The"
                    f" forward hands block {start} more than the previous block's output (a value one block passes"
                    " the next), so the stage cannot start there. Cut elsewhere with pipeline_split_points=[...],"
                    " or train this model without pipeline parallelism."
                ) from error
            if s < last and not cut:
                raise ValueError(
                    f"Pipeline split: {where} never ran its last block: the model's forward does not call the blocks of"
                    f" '{stack.prefix}' one after another. Name the stack it does iterate with block_stack='...'."
                )
            got, expected = (value, outputs.get(stop - 1)) if s < last else (_loss(value), reference_loss)
            if expected is None or not _close(got, expected):
                raise ValueError(
                    f"Pipeline split: {where} computes something else than the model's own forward (its output differs"
                    f" from block {stop - 1}'s{'' if s < last else ' / the loss'}). The forward uses more than the"
                    " previous block's output between blocks (a value from before the stack, per-block state), so this"
                    " split would train wrong. Cut elsewhere with pipeline_split_points=[...], name another block stack"
                    " with block_stack='...', or train this model without pipeline parallelism."
                )
            if incoming is not None:  # a random change of the input must change the output
                moved = run(incoming + seeded_noise(incoming.shape, s, incoming.device, incoming.dtype))[1]
            else:
                moved = None
            # Not depending on the input gives bit-identical results; any dependence changes them at least a little.
            if moved is not None and torch.equal(moved if s < last else _loss(moved), got):
                raise ValueError(
                    f"Pipeline split: the output of {where} does not depend on its input (the activation of the stage"
                    f" before): the model's forward does not feed block {start} the previous block's output. Name the"
                    " block stack its forward chains with block_stack='...', or do without pipeline parallelism."
                )
            incoming = value
        return replicate
    finally:
        widen_blocks(blocks, original_class)
        module.train(was_training)


def _check_calls(stack: BlockStack, calls: Sequence[int]) -> None:
    """A stage holds a run of consecutive blocks, entered once with the previous block's output: refuse a forward
    that calls a block twice (looped or recurrent-depth models, a block shared at two depths) or out of order,
    before any comparison. Such a model can compute nearly what its split does (at initialization a looped
    block may change its input little), so comparing outputs alone could pass it."""
    twice = sorted({i for i in calls if calls.count(i) > 1})
    rounds, whole = len(calls) // max(stack.total, 1), list(range(stack.total))
    if twice and rounds > 1 and list(calls) == whole * rounds:
        raise ValueError(
            f"Pipeline split: one training step runs the whole block stack '{stack.prefix}' {rounds} times, in order:"
            f" the step calls the model {rounds} times (a chosen and a rejected batch for a preference loss, two"
            " views for a contrastive one), or the model loops over its stack. A pipeline runs one forward per"
            " microbatch through the stages. Concatenate the inputs into one batch, call the model once and split"
            " its output in the loss; or train without pipeline parallelism (pipeline_parallel=1)."
        )
    if twice:
        i = twice[0]
        raise ValueError(
            f"Pipeline split: the model's forward calls block {i} of '{stack.prefix}' {calls.count(i)} times in one"
            f" step (blocks called more than once: {twice}; a looped, recurrent-depth or weight-shared stack). A"
            " pipeline stage holds consecutive blocks, each run once on the previous block's output, so this model"
            " cannot be split into stages. Train it without pipeline parallelism (pipeline_parallel=1); tensor and"
            " data parallelism take it."
        )
    if list(calls) != sorted(calls):
        raise ValueError(
            f"Pipeline split: the model's forward calls the blocks of '{stack.prefix}' out of order ({list(calls)}),"
            " and a pipeline runs them first to last. Name the stack its forward runs in order with"
            " block_stack='...', or train this model without pipeline parallelism (pipeline_parallel=1)."
        )


def _sensitivities(run: Callable[[Tensor], tuple[bool, Any]], incoming: Tensor, last: bool,
                   params: Sequence[nn.Parameter]) -> list[Tensor | None]:
    """A stage's output and the gradients it produces: of its input (sent to the stage before) and of every
    trainable parameter, for a fixed random output gradient (the loss's own on the last stage)."""
    with torch.enable_grad():
        x = incoming.detach().requires_grad_(incoming.is_floating_point())
        out = run(x)[1]
        out = _loss(out) if last else out
        if not out.requires_grad:
            return [out.detach()]
        if last:
            target = out.float().sum()
        else:
            target = (out.float() * seeded_noise(out.shape, 0, out.device, torch.float32)).sum()
        inputs = [x, *params] if x.requires_grad else list(params)
        grads = torch.autograd.grad(target, inputs, allow_unused=True)
    return [out.detach(), *grads]


def _reads_before(stand_ins: dict[str, nn.Module], probe: Callable[[], list[Tensor | None]]) -> bool:
    """On a later stage the modules before the stack (the embedding) are stand-ins returning zeros, and the first
    block's input is replaced by the activation received. Whether the stage's output or gradients (of its input
    and of any parameter) change when the stand-ins return random values instead: its blocks read a value from
    before the stack besides that input. At initialization such a path can change the output too little for the
    comparison with the whole run to tell (Zamba's blocks concatenate the embeddings), or not at all: Gemma-3n's
    per-layer inputs enter through a scale initialized to zero, so only gradients see them. This test does not
    depend on a tolerance."""
    before = {n: m for n, m in stand_ins.items() if isinstance(m, _StandIn) and m.before_stack}
    try:
        zeros = probe()
        for seed, stand_in in enumerate(before.values()):
            stand_in.noise = seed + 1
        moved = probe()
        same = len(zeros) == len(moved) and all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(zeros, moved)
        )
    except Exception:  # noqa: BLE001 - failing on the stand-ins' values is depending on them too
        same = False
    finally:
        for stand_in in before.values():
            stand_in.noise = None
    return not same
