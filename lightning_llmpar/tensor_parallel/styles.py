"""DTensor parallel styles for the layouts real models use, beyond torch's Linear/Embedding styles.

Every style keeps parameters as DTensors (so FSDP2, clipping, optimizers and checkpoints see them) and
hands the model's own code plain local tensors. "Token dim" is the dim before the features: 1 for
``(batch, seq, hidden)``, 0 for the ``(tokens, hidden)`` views some blocks take (OPT, MoE layers), so
sequence parallelism and its gather/scatter follow whatever view the model uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module

from lightning_llmpar.modeling.packing import Packing, on_rows, to_packed
from lightning_llmpar.modeling.structure import first_arg_name
from lightning_llmpar.tensor_parallel.lora import check_lora, is_lora

__all__ = [
    "VocabEmbedding",
    "require_all",
    "SplitLinear",
    "SplitExperts",
    "HeadSlice",
    "PrepareFirstInput",
    "GatherFirstOutput",
    "is_conv1d",
    "TOKEN",
]

TOKEN = "token"  # placeholder layout: Shard(token dim) of whatever the tensor is


def _resolve(layout: Placement | str, tensor: Tensor) -> Placement:
    return Shard(tensor.dim() - 2) if layout == TOKEN else layout  # type: ignore[return-value]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): a linear layer storing its weight as (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def _distribute(param: Tensor, mesh: DeviceMesh, placement: Placement, packing: Packing | None = None) -> nn.Parameter:
    data = to_packed(param.detach(), packing) if packing is not None else param
    return nn.Parameter(distribute_tensor(data, mesh, [placement]), requires_grad=param.requires_grad)


# Set on the local tensor a region's code receives (see PrepareFirstInput): the replicated DTensor it is a view
# of, and the tensor's version then.
_REGION_INPUT = "_llmpar_region_input"


def _region_input(tensor: Any, mesh: DeviceMesh) -> DTensor | None:
    """The DTensor behind a region's input, if ``tensor`` is that input, unchanged since."""
    if torch.compiler.is_compiling():
        return None  # compiled code can neither trace a DTensor held on a tensor nor read its version
    held = getattr(tensor, _REGION_INPUT, None)
    if held is None or held[1] != tensor._version or held[0].device_mesh != mesh:
        return None  # an in-place change since would be missing from the DTensor's autograd history
    return held[0]


def _to_dtensor(tensor: Tensor, mesh: DeviceMesh, current: Placement | str, desired: Placement | str) -> DTensor:
    dt = tensor if isinstance(tensor, DTensor) else DTensor.from_local(tensor, mesh, (_resolve(current, tensor),), run_check=False)
    target = _resolve(desired, tensor)
    return dt if dt.placements == (target,) else dt.redistribute(placements=(target,))


class SplitLinear(ParallelStyle):
    """Column (``kind='col'``: by output features) or row (``'row'``: by input features) split of a Linear,
    a transformers ``Conv1D`` (weight stored transposed) or a fused projection (``packing``: each rank holds
    its slice of every piece). ``input``/``output``: layouts of the local tensors the model passes in and
    gets back (``TOKEN`` for sequence-parallel activations); col output defaults to local features."""

    def __init__(
        self,
        kind: str,
        *,
        input: Placement | str | None = None,
        output: Placement | str | None = None,
        packing: Packing | None = None,
    ) -> None:
        super().__init__()
        if kind not in ("col", "row"):
            raise ValueError(f"SplitLinear kind must be 'col' or 'row', got {kind!r}.")
        self.kind, self.packing = kind, packing
        self.input = input or (Replicate() if kind == "col" else Shard(-1))
        self.output = output or (Shard(-1) if kind == "col" else Replicate())

    def weight_placement(self, module: nn.Module) -> Placement:
        out_dim = 1 if is_conv1d(module) else 0
        return Shard(out_dim if self.kind == "col" else 1 - out_dim)

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:  # distribute_module visits submodules too; only the projection itself is split
            return
        weight = self.weight_placement(module)
        module.register_parameter("weight", _distribute(module.weight, mesh, weight, self.packing))
        bias = getattr(module, "bias", None)
        if isinstance(bias, Tensor):
            placement = Shard(0) if self.kind == "col" else Replicate()
            module.register_parameter("bias", _distribute(bias, mesh, placement, on_rows(self.packing)))

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        if self.kind == "col" and self.input == Replicate() and (shared := _region_input(inputs[0], mesh)) is not None:
            # Every column split of a region reads the region's own DTensor: their partial input gradients add up
            # there and are reduced once per region, not once per projection (Megatron's "f").
            return (shared, *inputs[1:])
        desired = Replicate() if self.kind == "col" else Shard(-1)
        return (_to_dtensor(inputs[0], mesh, self.input, desired), *inputs[1:])

    def _prepare_output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> Tensor:
        target = _resolve(self.output, output)
        if output.placements != (target,):
            output = output.redistribute(placements=(target,))
        if self.kind == "row":
            # Models add residuals into a projection's output in place (Falcon's `mlp_output += attn_output`);
            # autograd forbids that on the view to_local returns, so hand out a tensor of its own.
            return output.to_local().clone()
        return output.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if is_lora(module):  # a peft LoRA layer: its base layer split so, its adapters to match (lora.py)
            return self._split_lora(module, device_mesh)
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise ValueError(f"SplitLinear splits nn.Linear or transformers Conv1D layers, not {type(module).__name__}.")
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            lambda mod, inputs, mesh: self._prepare_input(mod, inputs, mesh),
            lambda mod, outputs, mesh: self._prepare_output(mod, outputs, mesh),
        )

    def _split_lora(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        check_lora(module, type(module).__name__)
        parallelize_module(module.base_layer, mesh, self)
        for key in module.lora_A:
            lora_a, lora_b = module.lora_A[key], module.lora_B[key]
            if self.kind == "col":  # A whole on the replicated input; B split by outputs, per piece if fused
                if self.input == TOKEN:  # the base layer gathers this rank's tokens itself (an inline MLP): A too
                    parallelize_module(lora_a, mesh, PrepareFirstInput(TOKEN, Replicate()))
                parallelize_module(lora_b, mesh, SplitLinear("col", input=Replicate(), packing=on_rows(self.packing)))
            else:  # A split by inputs, its output summed; B whole, its output cut as the base layer's is (this
                # rank's tokens under SP, its heads' values for a projection onto heads)
                parallelize_module(lora_a, mesh, SplitLinear("row", input=self.input, output=Replicate()))
                if self.output != Replicate():
                    parallelize_module(lora_b, mesh, GatherFirstOutput(Replicate(), self.output))
        return module

    def __repr__(self) -> str:
        packed = f", packing={self.packing.sizes}" if self.packing is not None else ""
        return f"SplitLinear({self.kind}, input={self.input}, output={self.output}{packed})"


def _identity_forward_sum_backward(tensor: Tensor, mesh: DeviceMesh) -> Tensor:
    """Megatron's "f": the same tensor forward, gradients summed over the tensor-parallel ranks."""
    return DTensor.from_local(tensor, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


class SplitExperts(ParallelStyle):
    """Fused MoE experts (3-D ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)) split along each expert's
    FFN width I: every rank runs every expert on its slice, so outputs are partial sums over ranks.

    The module runs its own code on local tensors. Its token and routing-weight inputs get Megatron's
    identity-forward / sum-backward, so the router (replicated) receives the full gradient; its output
    is summed over ranks."""

    def __init__(self, params: dict[str, tuple[int | None, Packing | None]]) -> None:
        super().__init__()
        # name -> (split dim, packing); dim None: a bias added to each expert's output (E, H), whole, which the
        # module sees divided over the ranks, since the output is summed over them (Partial).
        self.params = params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, (dim, packing) in self.params.items():
            placement = Replicate() if dim is None else Shard(dim)
            owner, _, leaf = name.rpartition(".")  # a child's, dotted (DBRX's experts hold theirs in .mlp)
            holder = module.get_submodule(owner) if owner else module
            holder.register_parameter(leaf, _distribute(getattr(holder, leaf), device_mesh, placement, packing))
        summed = {name for name, (dim, _) in self.params.items() if dim is None}
        tp = device_mesh.size()

        def local(name: str, p: DTensor) -> Tensor:
            if name not in summed:
                return p.to_local()
            # Each rank's share; its gradient summed over the tensor-parallel ranks (the dim it is replicated on; an
            # expert-parallel split in front stays as it is).
            grads = [Partial() if isinstance(pl, Replicate) else pl for pl in p.placements]
            return p.to_local(grad_placements=grads) / tp

        _local_params_in_forward(module, list(self.params), local)

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            def f(a: Any) -> Any:  # tokens and routing weights: their gradients are partial per rank
                floating = isinstance(a, Tensor) and a.is_floating_point()
                return _identity_forward_sum_backward(a, device_mesh) if floating else a

            return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}

        def after(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            out = _to_dtensor(output, device_mesh, Partial(), Replicate()).to_local()
            # A view returned from an FSDP unit (experts under expert parallelism) loses FSDP's pre-backward hook
            # if the model then updates it in place.
            return out.clone() if isinstance(mod, FSDPModule) and out._is_view() else out

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)
        return module


class HeadSlice(ParallelStyle):
    """Per-head tensors built outside the attention for all heads (ALiBi biases, per-head masks): each rank
    keeps its own heads. ``kwargs`` maps an argument name to ``(heads, dim, batch_major)``: the head dim of
    the tensor, or, when ``batch_major``, heads folded into dim 0 as batch x heads (Bloom's ALiBi)."""

    def __init__(self, kwargs: dict[str, tuple[int, int, bool]]) -> None:
        super().__init__()
        self.kwargs = kwargs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()

        def keep(tensor: Tensor, heads: int, dim: int, batch_major: bool) -> Tensor:
            if not isinstance(tensor, Tensor):
                return tensor
            if batch_major:
                folded = tensor.reshape(-1, heads, *tensor.shape[1:])
                return folded.narrow(1, rank * heads // tp, heads // tp).reshape(-1, *tensor.shape[1:])
            if tensor.dim() <= dim or tensor.shape[dim] != heads:
                return tensor  # e.g. a mask shared by all heads
            return tensor.narrow(dim, rank * heads // tp, heads // tp)

        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            for name, spec in self.kwargs.items():
                if name in kwargs:
                    kwargs = {**kwargs, name: keep(kwargs[name], *spec)}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _local_params_in_forward(module: nn.Module, names: list[str], local: Any = lambda name, p: p.to_local()) -> None:
    """The module's code runs on ``local(name, tensor)`` of its DTensor parameters (or buffers) ``names`` (dotted
    for a submodule's), swapped in for its forward and back after, so its own code needs no DTensor support.

    The swap back runs even when the forward is cut short: activation checkpointing stops recomputing a block once
    backward has what it needs, which can be inside this module, and the module would otherwise keep local tensors
    where the optimizer, clipping and checkpoints expect its parameters. Hooks, not a wrapped forward, so that code
    wrapping the forward later (expert parallelism's routing) sees the local tensors too."""
    slots = []
    for name in names:
        owner, _, leaf = name.rpartition(".")
        holder = module.get_submodule(owner) if owner else module
        slots.append((name, holder._parameters if leaf in holder._parameters else holder._buffers, leaf))
    held: list[list[tuple[dict, str, Any]]] = []  # one entry per forward in progress

    def before(mod: nn.Module, args: tuple) -> None:
        entry = [(store, leaf, store[leaf]) for _, store, leaf in slots]
        for (name, store, leaf), (_, _, whole) in zip(slots, entry):
            store[leaf] = local(name, whole)
        held.append(entry)

    def after(mod: nn.Module, args: tuple, output: Any) -> None:
        for store, leaf, whole in held.pop() if held else ():
            store[leaf] = whole

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after, always_call=True)


class PrepareFirstInput(ParallelStyle):
    """Redistribute only the first tensor argument of a module (positional or keyword).

    ``PrepareModuleInput`` insists on a layout for every positional argument; blocks of real models
    take extra arguments (masks, rotary tables) that must pass through untouched. A replicated result
    (a region's input) remembers its DTensor for the region's column splits. Anything else the region
    does with the tensor keeps its own, whole, gradient, which DTensor adds to theirs before reducing.
    """

    def __init__(self, current: Any, desired: Any) -> None:
        super().__init__()
        self.current, self.desired = current, desired

    def _convert(self, tensor: Any, mesh: DeviceMesh) -> Any:
        if tensor is None or not hasattr(tensor, "shape"):
            return tensor
        if self.desired == TOKEN and not isinstance(tensor, DTensor) and tensor.shape[tensor.dim() - 2] % mesh.size():
            raise ValueError(
                f"Sequence parallelism splits the sequence over tensor_parallel({mesh.size()}) ranks, but this"
                f" batch has sequence length {tensor.shape[tensor.dim() - 2]}. Use lengths divisible by"
                f" {mesh.size()} (pad on the right: pad_to_multiple_of={mesh.size()} in transformers' collators), or set"
                " sequence_parallel=False."
            )
        if self.current == self.desired == Replicate() and not isinstance(tensor, DTensor):
            # Nothing to move: the region gets a plain view it may change in place (to_local's may not), and
            # its column splits a DTensor of that view.
            local = tensor.view_as(tensor)
            dt = DTensor.from_local(local, mesh, (Replicate(),), run_check=False)
        else:
            dt = _to_dtensor(tensor, mesh, self.current, self.desired)
            local = dt.to_local()
        if dt.placements == (Replicate(),) and not torch.compiler.is_compiling():
            setattr(local, _REGION_INPUT, (dt, local._version))
        return local

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
    """Redistribute the first tensor of a module's output (a tensor, or a tuple or list led by one). The result is
    a tensor of its own, as a module's output is, not the view ``DTensor.to_local`` returns: code after the module
    may change it in place (autograd forbids that on the view), and FSDP2 warns of a view leaving one of its units
    (the last block's output, which this gathers under sequence parallelism)."""

    def __init__(self, current: Any, desired: Any) -> None:
        super().__init__()
        self.current, self.desired = current, desired

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = first_arg_name(module)

        def convert(tensor: Any, given: Any) -> Any:
            if (self.desired == TOKEN and isinstance(given, Tensor) and tensor.dim() < given.dim()
                    and tensor.shape[-1] == given.shape[-1] and tensor.numel() == given.numel()):
                # The module flattened (batch, seq) into one token dim (Llama 4's MoE layer): shard the sequence
                # as its input was, not the flat token list, then flatten this rank's tokens the same way.
                local = _to_dtensor(tensor.view(given.shape), device_mesh, self.current, self.desired).to_local()
                return local.flatten(0, given.dim() - tensor.dim()).clone()
            return _to_dtensor(tensor, device_mesh, self.current, self.desired).to_local().clone()

        def hook(_mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            given = args[0] if args else kwargs.get(first)
            if isinstance(output, list):  # OpenAI GPT's blocks return lists
                return [convert(output[0], given), *output[1:]]
            if isinstance(output, tuple):
                return (convert(output[0], given), *output[1:])
            return convert(output, given)

        module.register_forward_hook(hook, with_kwargs=True)
        return module


class VocabEmbedding(RowwiseParallel):
    """The embedding split by vocabulary, its partial lookups summed. Its output is a tensor of its own, as an
    embedding's is: models scale it in place (CTRL: ``inputs_embeds *= sqrt(d)``), which autograd forbids on the
    view that ``DTensor.to_local`` returns. An id outside the vocabulary falls in no rank's slice and would embed
    as zeros, silently, where one process raises: it raises here too."""

    @staticmethod
    def _prepare_input_fn(input_layouts: Any, desired_input_layouts: Any, mod: nn.Module, inputs: Any,
                          device_mesh: Any) -> Any:
        ids = inputs[0].to_local() if isinstance(inputs[0], DTensor) else inputs[0]
        size = mod.num_embeddings  # type: ignore[attr-defined]  # the whole vocabulary's, kept by the split
        valid = (ids >= 0) & (ids < size)
        require_all(valid, lambda: (
            f"Token ids {sorted(set(ids[~valid].tolist()))[:5]} are outside the embedding's vocabulary of {size} (ids"
            f" 0 to {size - 1}); one process raises on them too. Check the tokenizer against the model's vocab_size."))
        return RowwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                           device_mesh: Any) -> Any:
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if use_local_output else out


def require_all(valid: Tensor, message: Callable[[], str]) -> None:
    """Raise ``IndexError(message())`` unless every entry of ``valid`` holds; on a GPU a device-side assert, which
    does not wait for the device. Ids a vocabulary split puts in no rank's slice, refused as one process does."""
    if valid.device.type == "cuda":
        torch._assert_async(valid.all(), "an index outside the vocabulary")
    elif not bool(valid.all()):
        raise IndexError(message())
