"""The plan outside the transformer blocks: the embedding and the LM head split by vocabulary, and tied
parameters split alike."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_llmpar.modeling.packing import Packing
from lightning_llmpar.tensor_parallel.entries import join as _join
from lightning_llmpar.tensor_parallel.lora import check_lora, is_lora, lora_parameter_names
from lightning_llmpar.tensor_parallel.param_styles import ReplicatedOnShards
from lightning_llmpar.tensor_parallel.shared_heads import SharedKVHeads
from lightning_llmpar.tensor_parallel.styles import SplitLinear, VocabEmbedding

__all__ = ["LORA_SPLITS", "check_adapters", "check_ties", "plan_outside", "weight_placement"]

# The styles that split a peft LoRA layer with its adapters: a projection's column or row split, and a projection
# onto key/value heads the ranks share.
LORA_SPLITS = (SplitLinear, SharedKVHeads)


def plan_outside(model: nn.Module, tp: int, styles: dict[str, Any], claimed: set[str], stack_prefix: str | None,
                 vocab_heads: list[str] | None = None) -> None:
    """Outside the block stack: split the embedding and the LM head by vocabulary (``claimed``: the user's); the
    heads' names go to ``vocab_heads``."""

    def inside_stack(name: str) -> bool:
        return stack_prefix is not None and (name == stack_prefix or name.startswith(stack_prefix + "."))

    modules = [(n, m) for n, m in model.named_modules() if n and not inside_stack(n) and n not in claimed]
    # A pipeline rank without the embedding still knows the vocabulary from the stand-in left in its place.
    vocab_sizes = {m.num_embeddings for m in model.modules() if isinstance(getattr(m, "num_embeddings", None), int)}
    heads = [(n, m) for n, m in modules if isinstance(m, nn.Linear) and m.out_features in vocab_sizes]
    vocab = max((m.out_features for _, m in heads), default=max(vocab_sizes, default=0))
    for name, module in modules:
        # An embedding class holding modules of its own (Inkling-2's) is kept whole: torch's style splits a plain one.
        if isinstance(module, nn.Embedding) and module.num_embeddings == vocab and not any(module.children()):
            styles[name] = VocabEmbedding(input_layouts=Replicate(), output_layouts=Replicate())
    for name, module in heads:
        if module.out_features == vocab:
            # The LM head: split the vocabulary and gather full logits so the user's loss is unchanged.
            styles[name] = SplitLinear("col", output=Replicate())
            if vocab_heads is not None:
                vocab_heads.append(name)

def check_ties(model: nn.Module, styles: dict[str, Any]) -> None:
    """Refuse a plan that splits two tied parameters differently, which would untie them."""
    owners: dict[int, tuple[str, Any]] = {}
    used = {id(p) for m in model.modules() if not any(m.children()) for p in m.parameters(recurse=False)}
    for name, module in model.named_modules():
        style = styles.get(name)
        for pname, param in module.named_parameters(recurse=False):
            if style is None and any(module.children()) and id(param) in used:
                continue  # an alias a parent keeps of a layer's parameter (BERT's head of its decoder's bias): retied
            placement = weight_placement(style, module) if pname == "weight" or style is None else None
            if id(param) in owners:
                other, other_placement = owners[id(param)]
                if placement is None or placement != other_placement:
                    raise ValueError(
                        f"Parameter '{_join(name, pname)}' is tied to '{other}', but the plan splits them"
                        f" differently ({other_placement} vs {placement}), which would untie them. Split both the"
                        f" same way: the default plan shards an embedding and its tied LM head by vocabulary;"
                        f" or keep both whole: tp_plan={{'{other.rsplit('.', 1)[0]}': 'replicate', '{name}':"
                        f" 'replicate'}}."
                    )
            else:
                owners[id(param)] = (_join(name, pname), placement)


def weight_placement(style: ParallelStyle | None, module: nn.Module) -> Placement | None:
    """How ``style`` places ``module.weight`` (None: unknown), for checking that tied weights agree."""
    if style is None:
        return Replicate()
    if isinstance(style, SplitLinear):
        return None if style.packing is not None else style.weight_placement(module)
    if isinstance(module, nn.Embedding) and isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return Shard(1) if isinstance(style, ColwiseParallel) else Shard(0)
    if isinstance(module, nn.Linear) and isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return Shard(0) if isinstance(style, ColwiseParallel) else Shard(1)
    if isinstance(style, ReplicatedOnShards):
        return Replicate()
    return None


def check_adapters(model: nn.Module, styles: dict[str, Any], packings: dict[str, Packing]) -> None:
    """Every peft LoRA layer is split as the projection it wraps (lora.py) or kept whole with it; any other adapter
    module is refused. A packing recorded for a LoRA layer's weight applies to its base layer and its lora_B."""
    for name, module in model.named_modules():
        if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
            continue
        style = styles.get(name)
        inside = [k for k, s in styles.items() if s is not None and k.split("#", 1)[0].startswith(name + ".")]
        if style is None and not inside:
            continue  # kept whole, with its base layer: every rank computes it alike
        if not (isinstance(style, LORA_SPLITS) and is_lora(module)):
            raise ValueError(
                f"Module '{name}' is a LoRA adapter (peft) around a module that tensor parallelism splits other than"
                " as a projection (an embedding, the output head, MoE experts). Leave it out of the adapters'"
                " target_modules, or fine-tune with pipeline_parallel and/or data parallelism (zero_stage 0-3), which"
                " take it as it is."
            )
        check_lora(module, name)
        for suffix in ("weight", "bias"):
            packing = packings.pop(f"{name}.{suffix}", None)
            for target in lora_parameter_names(module, name) if packing is not None else ():
                if isinstance(getattr(model.get_submodule(target), suffix, None), nn.Parameter):
                    # lora_B is an nn.Linear even around a Conv1D (weight (in, out)): its outputs are rows.
                    dim = packing.dim if target.endswith("base_layer") or suffix == "bias" else 0
                    packings[f"{target}.{suffix}"] = Packing(dim, packing.sizes, packing.tp)
