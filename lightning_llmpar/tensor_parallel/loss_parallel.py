"""Loss parallelism: the LM head's logits stay split over the vocabulary and the cross-entropy runs in parallel.

With 128k-256k vocabularies the logits are the largest activation of a step. Under tensor parallelism the head
is split by vocabulary rows anyway; gathering its output to the full vocabulary on every rank only so that the
user's ``F.cross_entropy`` can read it costs ``tp`` times the memory. Here the head hands the training step a
``DTensor`` sharded on its last dim instead, and the cross-entropy on it runs under torch's ``loss_parallel``
(max and sum-of-exponentials all-reduced over the tensor-parallel ranks; nothing of vocabulary size is gathered).

The user's step is arbitrary code, so the split logits are watched from the head's output to the end of the step
(a ``TorchFunctionMode``, pushed only once the head has run, so the model's own forward runs untouched):

- ``F.cross_entropy`` (``nn.CrossEntropyLoss``, transformers' causal-LM loss) on them: parallel, exact; the loss comes
  back as a plain tensor, whole on every rank.
- Any op DTensor computes that keeps the vocabulary split (``float()``, ``view(-1, V)``, slicing the sequence,
  softcapping): the result is watched the same way.
- Anything else (``argmax``, ``softmax``, a z-loss, mixing with plain tensors): that op gets the whole logits,
  gathered for it (differentiably, as the head gathered them before), so the result is the one-process result. With
  ``loss_parallel=True`` this is refused instead, naming the op, since it spends the memory the option saves;
  ``'auto'`` warns once.
- An in-place change of the split logits that DTensor cannot do is refused (a gathered copy would not carry it).

At the end of the step whatever split logits the step returns are gathered whole, so nothing split leaves it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.overrides import TorchFunctionMode, _get_current_function_mode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_llmpar.tensor_parallel.styles import SplitLinear, require_all
from lightning_llmpar.training.ignore_index import note_loss_call

__all__ = ["LossParallel", "VocabParallelHead", "split_backward", "split_logits"]

log = logging.getLogger(__name__)

_VOCAB = "_llmpar_vocab"  # on a DTensor of split logits: the vocabulary size
_CE = inspect.signature(F.cross_entropy)


class LossParallel:
    """The state shared by the strategy's step and the vocabulary-parallel heads: whether a training step is running
    (the heads split their output only then), the watching mode once a head has run, and the policy for other uses
    of the split logits (``strict``: refuse them; else gather the logits for them, warning once)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.active = False
        self._mode: _SplitLogitsMode | None = None
        self._unrecorded = False  # the step ran ops on split logits without recording them (a reentrant checkpoint)
        self._warned = False
        self.why = ""  # what kept the last cross-entropy from running in parallel
        # What the heads handed out split (for checks and benchmarks): steps, this rank's bytes of the last logits,
        # and the ops that needed them gathered.
        self.split_steps = 0
        self.local_bytes = 0
        self.gathered_ops: set[str] = set()

    @contextmanager
    def step(self) -> Iterator[Callable[[Any], Any]]:
        """One training step: heads keep their output split. Yields what gathers split logits in the step's output
        whole (for callbacks and hooks that read it), so nothing split leaves the step."""
        self.active = True
        try:
            yield finish
        finally:
            self.active = False
            mode, self._mode = self._mode, None
            if mode is not None:
                if _get_current_function_mode() is not mode:
                    raise RuntimeError("loss parallelism: another torch function mode was left open inside the step")
                mode.__exit__(None, None, None)

    @contextmanager
    def backward(self, loss: Tensor) -> Iterator[None]:
        """The backward of ``loss``, where a reentrant checkpoint reruns its function (the cross-entropy of a chunk
        of the split logits): the logits are watched again while it does. Not by this mode, off by then (the step
        ended) or off while it handles ``backward()`` itself: by hooks on the checkpoints' nodes, which the engine
        runs around the rerun."""
        if not self._unrecorded or loss.grad_fn is None:
            yield
            return
        self._unrecorded = False
        pushed: list[_SplitLogitsMode] = []
        for node in _reentrant_checkpoints(loss.grad_fn):
            node.register_prehook(lambda _: pushed.append(_SplitLogitsMode(self).__enter__()))
            node.register_hook(lambda *_: pushed.pop().__exit__(None, None, None))
        try:
            yield
        finally:
            while pushed:  # a rerun that raised
                pushed.pop().__exit__(None, None, None)

    def watch(self, logits: DTensor) -> DTensor:
        setattr(logits, _VOCAB, logits.shape[-1])
        local = logits.to_local()
        self.local_bytes = local.numel() * local.element_size()
        if self._mode is None:
            self.split_steps += 1
            self._mode = _SplitLogitsMode(self)
            self._mode.__enter__()
        return logits

    def gathered(self, what: str) -> None:
        """An op needed the whole logits: refuse it (strict) or note it once."""
        self.gathered_ops.add(what)
        why, self.why = self.why, ""
        message = (
            f"the training step computes `{what}` on the LM head's logits{why}, which loss parallelism keeps split over the"
            " vocabulary; it needs them whole, so they are gathered over the tensor-parallel ranks for it (the memory"
            " loss parallelism saves is spent again)."
        )
        if self.strict:
            raise ValueError(
                f"loss_parallel=True: {message} Compute only the cross-entropy on the logits in the training step"
                f"{' without it' if why else ''} (metrics such as accuracy in validation_step), or set loss_parallel='auto' to gather them where"
                " such an op needs them, or loss_parallel=False."
            )
        if not self._warned:
            self._warned = True
            rank_zero_warn(f"loss_parallel='auto': {message} Set loss_parallel=False to gather them in the head.")


@contextmanager
def split_logits(owner: LossParallel | None, tp: int) -> Iterator[Callable[[Any], Any]]:
    """A training step with ``owner``'s heads splitting their logits (see ``LossParallel.step``); none: as it is.
    Under tensor parallelism, a step reading a split weight directly is explained (see ``_split_weights_read``)."""
    with _split_weights_read(tp):
        if owner is None:
            yield lambda output: output
            return
        with owner.step() as done:
            yield done


@contextmanager
def split_backward(owner: LossParallel | None, loss: Tensor) -> Iterator[None]:
    """The backward of ``loss`` with ``owner``'s split logits watched where it reruns code on them (see
    ``LossParallel.backward``); none: as it is."""
    if owner is None:
        yield
        return
    with owner.backward(loss):
        yield


@contextmanager
def _split_weights_read(tp: int) -> Iterator[None]:
    """A training step whose own code mixes a split parameter with plain tensors (DTensor names only the op) is told
    why: it read a split module's weight, bypassing the module (a fused linear cross-entropy on the head's weight)."""
    try:
        yield
    except RuntimeError as err:
        if tp == 1 or "got mixed torch.Tensor and DTensor" not in str(err):
            raise
        raise ValueError(
            f"tensor_parallel={tp}: the training step computes `{str(err).split(' got')[0]}` on a plain tensor and a"
            " parameter that tensor parallelism splits over the ranks (a DTensor): its code reads a split module's"
            " weight directly, e.g. `hidden @ lm_head.weight.T` for a fused linear cross-entropy, which bypasses the"
            " module's own handling of its input and output. Call the module instead (`lm_head(hidden)`; with"
            " loss_parallel its logits stay split over the vocabulary and the cross-entropy on them is parallel), or"
            " keep the module whole with tp_plan={'<its name, e.g. model.lm_head>': 'replicate'} (and"
            " loss_parallel='auto' or False)."
        ) from err


def _reentrant_checkpoints(root: Any) -> list[Any]:
    """The reentrant checkpoints' nodes in ``root``'s graph."""
    kind = torch.utils.checkpoint.CheckpointFunction._backward_cls  # type: ignore[attr-defined]
    seen, todo, found = {root}, [root], []
    while todo:
        node = todo.pop()
        if isinstance(node, kind):
            found.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                todo.append(child)
    return found


def finish(output: Any) -> Any:
    """The step's output with split logits gathered whole (for callbacks and hooks that read it)."""
    return tree_map(lambda t: t.full_tensor() if _is_split(t) else t, output)


def _is_split(x: Any) -> bool:
    return isinstance(x, DTensor) and getattr(x, _VOCAB, None) is not None


def _still_split(x: Any, vocab: int) -> bool:
    """A DTensor with the vocabulary whole in one dim, split there and nowhere else."""
    if not isinstance(x, DTensor) or len(x.placements) != 1 or not x.placements[0].is_shard():
        return False
    dim = x.placements[0].dim  # type: ignore[attr-defined]
    return x.shape[dim] == vocab


class _ParallelCrossEntropy(torch.autograd.Function):
    """The parallel cross-entropy, with its backward under ``loss_parallel`` too, wherever autograd runs it (Lightning's
    backward, manual_backward, a pipeline schedule): torch's handlers replace log-softmax's backward by a pass-through
    that is only right while they are on."""

    @staticmethod
    def forward(ctx: Any, logits: DTensor, target: Tensor, weight: Tensor | None, ignore_index: int,
                reduction: str) -> DTensor:
        with torch.enable_grad():
            x = logits.detach().requires_grad_()
            with _loss_ops():
                loss = F.cross_entropy(x, target, weight, ignore_index=ignore_index, reduction=reduction)
        ctx.x, ctx.loss = x, loss
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        with _loss_ops():
            (dx,) = torch.autograd.grad(ctx.loss, ctx.x, grad)
        ctx.x = ctx.loss = None
        return dx, None, None, None, None


@contextmanager
def _loss_ops() -> Iterator[None]:
    # torch's loss_parallel() does not turn its handlers off when the body raises: exit it normally in any case.
    context = loss_parallel()
    context.__enter__()
    try:
        yield
    finally:
        context.__exit__(None, None, None)


def _parallel_cross_entropy(args: tuple, kwargs: dict) -> Tensor | str:
    """``F.cross_entropy`` on split logits in parallel, or what it was given that torch's loss_parallel does not take."""
    try:
        bound = _CE.bind(*args, **kwargs)
    except TypeError:
        return "arguments cross_entropy does not take"
    bound.apply_defaults()
    a = bound.arguments
    x, target, weight = a["input"], a["target"], a["weight"]
    class_dim = 1 if x.dim() >= 2 else 0
    unsupported = {"size_average/reduce": a["size_average"] is not None or a["reduce"] is not None,
                   f"label_smoothing={a['label_smoothing']}": a["label_smoothing"] != 0.0,
                   "logits split on another dimension": x.placements not in ((Shard(class_dim),), (Shard(class_dim - x.dim()),)),
                   "soft (probability) or split targets": not isinstance(target, Tensor) or isinstance(target, DTensor)
                   or target.is_floating_point(), "a split class weight": isinstance(weight, DTensor),
                   f"reduction={a['reduction']!r}": a["reduction"] not in ("mean", "sum", "none")}
    if any(unsupported.values()):
        return next(k for k, v in unsupported.items() if v)
    _check_targets(target, x.shape[class_dim], a["ignore_index"])
    note_loss_call(target, a["ignore_index"])  # what the step's token counts skip (training.ignore_index)
    if torch.is_grad_enabled() and x.requires_grad:
        loss = _ParallelCrossEntropy.apply(x, target, weight, a["ignore_index"], a["reduction"])
    else:
        with _loss_ops():
            loss = F.cross_entropy(x, target, weight, ignore_index=a["ignore_index"], reduction=a["reduction"])
    # Replicated: the whole loss on every rank, a plain tensor for the user's code. A copy, not to_local's view,
    # which autograd forbids changing in place (transformers adds an MoE router's auxiliary loss with +=).
    return loss.to_local().clone()


def _check_targets(target: Tensor, vocab: int, ignore_index: int) -> None:
    """A target outside the vocabulary falls in no rank's slice and would count as a zero logit, silently: one
    process raises on it, and so does this (on a GPU as a device-side assert, without waiting for the device)."""
    valid = (target == ignore_index) | ((target >= 0) & (target < vocab))
    require_all(valid, lambda: (f"Target {int(target[~valid][0])} is out of bounds (the vocabulary has {vocab}"
                                " entries, split over the tensor-parallel ranks); one process raises on it too."))


def _name(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return name.replace("_TensorBase.", "Tensor.").replace("TensorBase.", "Tensor.")


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


def _scalars_replicated(tree: Any, mesh: DeviceMesh) -> Any:
    """Plain one-element tensors that need a gradient (a learnable logit scale), replicated by ``from_local``.
    DTensor replicates such a scalar implicitly, but then hands its gradient back as a partial DTensor (each rank's
    sum over its part of the vocabulary), which the optimizer cannot apply to the plain parameter; ``from_local``'s
    backward sums it over the ranks into a plain tensor, the one-process gradient."""
    if not torch.is_grad_enabled():
        return tree

    def replicate(t: Any) -> Any:
        if isinstance(t, Tensor) and not isinstance(t, DTensor) and t.requires_grad and t.numel() == 1:
            return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return t

    return tree_map(replicate, tree)


class _SplitLogitsMode(TorchFunctionMode):
    """Watches every torch call on split logits until the step ends (see the module's docstring)."""

    def __init__(self, owner: LossParallel) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        split = [a for a in flat if _is_split(a)]
        if not split:
            return func(*args, **kwargs)
        return self._on_split(func, args, kwargs, split)

    # Eager under torch.compile (a compiled loss function): dynamo would trace the cross-entropy without the global
    # switch of DTensor's handlers that loss_parallel() is, and its aliasing of outputs (`float()` of fp32 logits)
    # needs as_strided, which DTensor lacks. Calls without split logits above stay in the graph.
    @torch.compiler.disable
    def _on_split(self, func: Any, args: tuple, kwargs: dict, split: list[DTensor]) -> Any:
        vocab = getattr(split[0], _VOCAB)
        if not torch.is_grad_enabled() and any(a.requires_grad for a in split):
            self.owner._unrecorded = True  # a reentrant checkpoint's first run (or a metric under no_grad)
        raw = args, kwargs  # for the whole logits: plain scalars mix with plain tensors
        args, kwargs = _scalars_replicated(raw, split[0].device_mesh)
        if func is F.cross_entropy and _is_split(args[0] if args else kwargs.get("input")):
            loss = _parallel_cross_entropy(args, kwargs)
            if isinstance(loss, Tensor):
                return loss
            self.owner.why = f" with {loss} (which torch's parallel cross-entropy does not take)"
        if _in_place(func):
            try:
                return func(*args, **kwargs)
            except Exception as err:
                raise ValueError(
                    f"The training step changes the LM head's logits in place with `{_name(func)}`, which cannot be"
                    " done on logits split over the vocabulary (loss parallelism). Compute a new tensor instead"
                    " (e.g. `logits = logits.masked_fill(...)`), or set loss_parallel=False."
                ) from err
        try:
            out = func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - DTensor has no rule for it, or it mixes DTensors with tensors: run it whole
            return self._whole(func, *raw)
        gathered = False

        def keep(t: Any) -> Any:
            nonlocal gathered
            if not isinstance(t, DTensor):
                return t
            if _still_split(t, vocab):
                setattr(t, _VOCAB, vocab)
                return t
            gathered = True
            return t.full_tensor()  # differentiable: its gradient comes back as this rank's part

        out = tree_map(keep, out)
        if gathered:
            self.owner.gathered(_name(func))
        return out

    def _whole(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self.owner.gathered(_name(func))
        args, kwargs = tree_map(lambda t: t.full_tensor() if _is_split(t) else t, (args, kwargs))
        return func(*args, **kwargs)


class VocabParallelHead(SplitLinear):
    """The LM head split by vocabulary (column split). During a training step with loss parallelism its output stays
    split (a DTensor sharded on the vocabulary, watched by ``owner``); otherwise it is gathered whole, as before."""

    def __init__(self, owner: LossParallel) -> None:
        super().__init__("col", output=Replicate())
        self.owner = owner

    def _prepare_output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> Tensor:
        if self.owner.active and output.placements == (Shard(output.dim() - 1),):
            return self.owner.watch(output)
        return super()._prepare_output(module, output, mesh)

    def __repr__(self) -> str:
        return "VocabParallelHead(col, output=Shard(-1) in training steps, Replicate otherwise)"
