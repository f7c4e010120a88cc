"""Megatron-style tensor parallelism for models we did not write: infer a DTensor plan, then apply it.

The plan maps qualified module names to ``torch.distributed.tensor.parallel`` styles: q/k/v and MLP
up/gate projections are split by output features (column-wise), output and down projections by input
features (row-wise), so each block needs one all-reduce (or one all-gather + reduce-scatter pair with
sequence parallelism) after attention and one after the MLP.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_llmpar.structure import find_block_stack, first_arg_name

__all__ = ["TP_STYLES", "infer_tp_plan", "apply_tensor_parallel", "HEAD_COUNT_ATTRS"]

_Q = {"q_proj", "q", "wq", "query", "q_lin", "to_q"}
_K = {"k_proj", "k", "wk", "key", "k_lin", "to_k"}
_V = {"v_proj", "v", "wv", "value", "v_lin", "to_v"}
_OUT = {"o_proj", "out_proj", "wo", "o", "proj", "c_proj", "dense", "out_lin", "to_out"}
_FUSED_QKV = {"qkv", "qkv_proj", "c_attn", "wqkv", "query_key_value", "in_proj", "w_pack"}
_UP = {"up_proj", "gate_proj", "w1", "w3", "fc1", "c_fc", "fc_in", "gate", "up", "dense_h_to_4h", "lin1"}
_DOWN = {"down_proj", "w2", "fc2", "fc_out", "c_proj", "down", "dense_4h_to_h", "lin2"}
_FUSED_UP = {"gate_up_proj", "w13", "fc1_gate"}

# Attributes an attention module may read to reshape into heads; they hold per-rank counts after TP.
HEAD_COUNT_ATTRS = (
    "num_heads", "n_heads", "n_head", "num_attention_heads", "n_local_heads",
    "num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "n_local_kv_heads",
)
# Width attributes (heads x head_dim) that some attention modules use to reshape their output.
_WIDTH_ATTRS = ("hidden_size", "embed_dim", "all_head_size", "inner_dim", "n_embd")

PlanEntry = ParallelStyle | None  # None: leave the module replicated


class PrepareFirstInput(ParallelStyle):
    """Redistribute only the first tensor argument of a module (positional or keyword).

    ``PrepareModuleInput`` insists on a layout for every positional argument; blocks of real models
    take extra arguments (masks, rotary tables) that must pass through untouched.
    """

    def __init__(self, current: Any, desired: Any) -> None:
        super().__init__()
        self.current, self.desired = current, desired

    def _convert(self, tensor: Any, mesh: DeviceMesh) -> Any:
        if tensor is None or not hasattr(tensor, "shape"):
            return tensor
        if self.desired == Shard(1) and not isinstance(tensor, DTensor) and tensor.shape[1] % mesh.size():
            raise ValueError(
                f"Sequence parallelism splits the sequence over tensor_parallel({mesh.size()}) ranks, but this"
                f" batch has sequence length {tensor.shape[1]}. Use lengths divisible by {mesh.size()}, or set"
                " sequence_parallel=False."
            )
        dt = tensor if isinstance(tensor, DTensor) else DTensor.from_local(tensor, mesh, (self.current,), run_check=False)
        return dt.redistribute(placements=(self.desired,)).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = first_arg_name(module)

        def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (self._convert(args[0], device_mesh), *args[1:]), kwargs
            if first in kwargs:
                kwargs = {**kwargs, first: self._convert(kwargs[first], device_mesh)}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class GatherFirstOutput(ParallelStyle):
    """Redistribute the first tensor of a module's output (a tensor or a tuple led by one)."""

    def __init__(self, current: Any, desired: Any) -> None:
        super().__init__()
        self.current, self.desired = current, desired

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def convert(tensor: Any) -> Any:
            dt = DTensor.from_local(tensor, device_mesh, (self.current,), run_check=False)
            return dt.redistribute(placements=(self.desired,)).to_local()

        def hook(_mod: nn.Module, _inputs: Any, output: Any) -> Any:
            if isinstance(output, tuple):
                return (convert(output[0]), *output[1:])
            return convert(output)

        module.register_forward_hook(hook)
        return module


# Styles an explicit plan can name (Python or YAML): module-name pattern -> one of these keys.
TP_STYLES: dict[str, Any] = {
    "colwise": lambda: ColwiseParallel(),
    "colwise_gather": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise": lambda: RowwiseParallel(),
    "rowwise_sequence": lambda: RowwiseParallel(output_layouts=Shard(1)),
    "embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": lambda: SequenceParallel(),
    "prepare_sequence": lambda: PrepareFirstInput(Shard(1), Replicate()),
    "replicate": lambda: None,
}


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()


def _join(prefix: str, name: str) -> str:
    if not name:
        return prefix
    return f"{prefix}.{name}" if prefix else name


def _user_style(name: str, user_plan: Mapping[str, str]) -> tuple[bool, PlanEntry]:
    for pattern, style in user_plan.items():
        if fnmatchcase(name, pattern):
            if style not in TP_STYLES:
                raise ValueError(
                    f"tp_plan[{pattern!r}] = {style!r} is not a known style. Use one of {sorted(TP_STYLES)}."
                )
            return True, TP_STYLES[style]()
    return False, None


def _linear_children(module: nn.Module) -> dict[str, nn.Linear]:
    return {n: c for n, c in module.named_children() if isinstance(c, nn.Linear)}


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and not any(True for _ in module.children())


def _check_attention(name: str, attn: nn.Module, q: nn.Linear, k: nn.Linear, tp: int) -> None:
    head_dim = getattr(attn, "head_dim", None)
    counts: dict[str, int] = {}
    for attr in HEAD_COUNT_ATTRS:
        value = getattr(attn, attr, None)
        if isinstance(value, int):
            counts[attr] = value
    if isinstance(head_dim, int) and head_dim > 0:
        counts.setdefault("query heads", q.out_features // head_dim)
        counts.setdefault("key/value heads", k.out_features // head_dim)
    counts.setdefault("query features", q.out_features)
    counts.setdefault("key/value features", k.out_features)
    for what, value in counts.items():
        if value % tp != 0:
            raise ValueError(
                f"Attention module '{name}': {what} = {value} is not divisible by tensor_parallel({tp})."
                f" Use a tensor_parallel degree that divides every head count ({counts})."
            )


def infer_tp_plan(
    model: nn.Module, tp: int, *, sequence_parallel: bool = True, user_plan: Mapping[str, str] | None = None
) -> dict[str, PlanEntry]:
    """Build the tensor-parallel plan for ``model``; raise a ValueError naming any module we cannot split."""
    user_plan = dict(user_plan or {})
    plan: dict[str, PlanEntry] = {}
    claimed: set[str] = set()
    for name, _ in model.named_modules():
        if not name:
            continue
        matched, style = _user_style(name, user_plan)
        if matched:
            plan[name] = style
            claimed.add(name)

    stack = find_block_stack(model)
    if stack is None and not user_plan:
        raise ValueError(
            f"Could not find a stack of transformer blocks (an nn.ModuleList of identical modules) in"
            f" {type(model).__name__}. Keep the blocks in one nn.ModuleList, or pass an explicit"
            f" `tp_plan` mapping module-name patterns to styles {sorted(TP_STYLES)}."
        )
    seq = sequence_parallel
    block_names = stack.names() if stack is not None else []
    for block_name, block in zip(block_names, stack.modules() if stack is not None else []):
        _plan_block(block_name, block, tp, seq, plan, claimed)
    if stack is not None and seq and block_names:
        # The sequence is sharded only inside the stack: embeddings and the head see the full sequence,
        # so models that derive positions or masks from the embedding's shape keep working. Under
        # pipeline parallelism only the ranks holding the first / last block do this.
        first, last = _join(stack.prefix, "0"), _join(stack.prefix, str(stack.total - 1))
        if first in block_names:
            plan.setdefault(first + "#in", PrepareFirstInput(Replicate(), Shard(1)))
        if last in block_names:
            plan.setdefault(last + "#out", GatherFirstOutput(Shard(1), Replicate()))
    _plan_outside(model, stack.prefix if stack is not None else None, tp, plan, claimed)
    _refuse_tied(model, plan)
    return plan


def _plan_block(
    block_name: str, block: nn.Module, tp: int, seq: bool, plan: dict[str, PlanEntry], claimed: set[str]
) -> None:
    covered: set[str] = set()
    regions: list[str] = []  # attention / MLP modules: between their column and row splits data is sharded
    for sub_name, sub in block.named_modules():
        full = _join(block_name, sub_name)
        children = _linear_children(sub)
        names = {n.lower(): n for n in children}
        _refuse_fused(full, names, claimed)
        # Sorted: every rank must shard modules in the same order, because sharding a parameter is a
        # collective (rank 0's values are scattered); set order differs between processes.
        qs, ks, vs = sorted(names.keys() & _Q), sorted(names.keys() & _K), sorted(names.keys() & _V)
        ups, downs = sorted(names.keys() & _UP), sorted(names.keys() & _DOWN)
        row_style = RowwiseParallel(output_layouts=Shard(1)) if seq else RowwiseParallel()
        if qs and ks and vs:
            _check_attention(full, sub, children[names[qs[0]]], children[names[ks[0]]], tp)
            for n in (*qs, *ks, *vs):
                _add(plan, claimed, covered, _join(full, names[n]), ColwiseParallel())
            for n in sorted(names.keys() & _OUT):
                _add(plan, claimed, covered, _join(full, names[n]), row_style)
            if seq:
                _add(plan, claimed, covered, full + "#attn_in", PrepareFirstInput(Shard(1), Replicate()))
            plan.setdefault(full + "#heads", None)
            regions.append(full)
        elif ups and downs:
            for n in ups:
                if children[names[n]].out_features % tp:
                    raise ValueError(
                        f"MLP projection '{_join(full, names[n])}' has {children[names[n]].out_features} output"
                        f" features, not divisible by tensor_parallel({tp}). Choose a degree that divides it."
                    )
                _add(plan, claimed, covered, _join(full, names[n]), ColwiseParallel())
            for n in downs:
                _add(plan, claimed, covered, _join(full, names[n]), row_style)
            if seq:
                _add(plan, claimed, covered, full + "#mlp_in", PrepareFirstInput(Shard(1), Replicate()))
            regions.append(full)

    def region_of(name: str) -> str | None:
        return next((r for r in regions if name == r or name.startswith(r + ".")), None)

    for sub_name, sub in block.named_modules():
        full = _join(block_name, sub_name)
        if full in claimed or full in covered:
            continue
        if isinstance(sub, nn.Linear):
            raise ValueError(
                f"Cannot decide how to split Linear '{full}' for tensor parallelism: it is neither a q/k/v/output"
                f" projection next to its siblings nor an MLP up/gate/down projection. Give it a style in tp_plan"
                f" (e.g. tp_plan={{'{full}': 'colwise'}} or 'rowwise'); if it works on the full hidden state"
                f" outside attention and MLP, tp_plan={{'{full}': 'replicate'}} with sequence_parallel=False."
            )
        if seq and _is_norm(sub) and region_of(full) is None:
            plan[full] = SequenceParallel(use_local_output=True)
    _refuse_partial_gradients(block, block_name, plan, seq, region_of)


def _refuse_fused(full: str, names: dict[str, str], claimed: set[str]) -> None:
    unclaimed = [n for n in sorted(names) if n in _FUSED_QKV | _FUSED_UP and _join(full, names[n]) not in claimed]
    if unclaimed:
        bad = _join(full, names[unclaimed[0]])
        raise ValueError(
            f"Module '{bad}' fuses several projections in one Linear. If its output rows are concatenated"
            f" ([all q; all k; all v] or [gate; up]), a column split would hand each rank a mix of them."
            f" If the rows are grouped per head / per key-value group (Megatron, GPT-NeoX layout), a column"
            f" split is right: say so with tp_plan={{'{bad}': 'colwise'}}. Otherwise split it into separate"
            f" Linear layers."
        )


_SPLIT_STYLES = (ColwiseParallel, RowwiseParallel, SequenceParallel)


def _refuse_partial_gradients(
    block: nn.Module, block_name: str, plan: Mapping[str, PlanEntry], seq: bool, region_of: Any
) -> None:
    """A whole (unsplit) parameter is only right where every rank sees the same full activations.

    Inside attention/MLP each rank holds different heads or features; with sequence parallelism the
    residual stream holds different tokens. A replicated parameter there would get a gradient from
    this rank's part only, with nothing summing the parts: refuse instead of training wrong.
    """
    for sub_name, sub in block.named_modules():
        full = _join(block_name, sub_name)
        if not any(True for _ in sub.parameters(recurse=False)) or isinstance(plan.get(full), _SPLIT_STYLES):
            continue
        region = region_of(full)
        if region is not None:
            raise ValueError(
                f"Module '{full}' holds parameters inside the tensor-parallel region '{region}', where each rank"
                f" holds only some heads or features, so its gradient would miss the other ranks' part. Give it a"
                f" splitting style in tp_plan ('colwise'/'rowwise'), or run this model without tensor parallelism."
            )
        if seq:
            raise ValueError(
                f"Module '{full}' holds parameters that no tensor-parallel style covers; with"
                f" sequence_parallel=True it would see only this rank's part of the sequence and get a partial"
                f" gradient. Set sequence_parallel=False, or tp_plan={{'{full}': 'sequence_parallel'}} if it is a"
                f" per-token op such as a norm."
            )


def _add(plan: dict[str, PlanEntry], claimed: set[str], covered: set[str], name: str, style: PlanEntry) -> None:
    covered.add(name)
    if name not in claimed:
        plan[name] = style


def _plan_outside(
    model: nn.Module, stack_prefix: str | None, tp: int, plan: dict[str, PlanEntry], claimed: set[str]
) -> None:
    def inside_stack(name: str) -> bool:
        return stack_prefix is not None and (name == stack_prefix or name.startswith(stack_prefix + "."))

    # A pipeline rank without the embedding still knows its size from the stand-in left in its place.
    vocab_sizes = {m.num_embeddings for m in model.modules() if isinstance(getattr(m, "num_embeddings", None), int)}
    for name, module in model.named_modules():
        if inside_stack(name) or name in claimed or not isinstance(module, nn.Embedding):
            continue
        if module.num_embeddings % tp:
            raise ValueError(
                f"Embedding '{name}' has {module.num_embeddings} rows, not divisible by tensor_parallel({tp})."
                f" Pad the vocabulary to a multiple of {tp}, or set tp_plan={{'{name}': 'replicate'}}."
            )
        plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for name, module in model.named_modules():
        if inside_stack(name) or name in claimed or not isinstance(module, nn.Linear):
            continue
        if module.out_features in vocab_sizes:
            # The LM head: split the vocabulary and gather full logits so the user's loss is unchanged.
            plan[name] = ColwiseParallel(output_layouts=Replicate())


def _refuse_tied(model: nn.Module, plan: Mapping[str, PlanEntry]) -> None:
    owners: dict[int, str] = {}
    for name, module in model.named_modules():
        if plan.get(name) is None:
            continue
        for pname, param in module.named_parameters(recurse=False):
            key = id(param)
            if key in owners and owners[key] != name:
                raise ValueError(
                    f"Parameter '{name}.{pname}' is tied to '{owners[key]}'; tied weights cannot be split by two"
                    f" different styles. Untie them (e.g. tie_word_embeddings=False), or keep both whole with"
                    f" tp_plan={{'{owners[key]}': 'replicate', '{name}': 'replicate'}}."
                )
            owners[key] = name


def _scale_head_counts(model: nn.Module, plan: Mapping[str, PlanEntry], tp: int) -> None:
    for key in plan:
        if not key.endswith("#heads"):
            continue
        attn_name = key[: -len("#heads")]
        attn = model.get_submodule(attn_name)
        q_width = None
        for name, child in _linear_children(attn).items():
            if name.lower() in _Q and isinstance(plan.get(_join(attn_name, name)), ColwiseParallel):
                q_width = child.out_features
        if q_width is None:
            continue  # q/k/v kept whole by an explicit plan: head counts stay as they are
        for attr in HEAD_COUNT_ATTRS:
            value = getattr(attn, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(attn, attr, value // tp)
        for attr in _WIDTH_ATTRS:
            value = getattr(attn, attr, None)
            if isinstance(value, int) and q_width is not None and value == q_width:
                setattr(attn, attr, value // tp)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, PlanEntry]) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` following ``plan`` (see :func:`infer_tp_plan`)."""
    tp = tp_mesh.size()
    # Module names in the plan may carry a '#tag' when one module gets several styles (e.g. a block's
    # input preparation and, separately, its output gathering): apply each style on its own.
    for key, style in plan.items():
        if style is None:
            continue
        name = key.split("#", 1)[0]
        module = model.get_submodule(name) if name else model
        parallelize_module(module, tp_mesh, style)
    _scale_head_counts(model, plan, tp)
    return model
