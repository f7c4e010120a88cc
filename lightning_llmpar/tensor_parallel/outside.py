"""The plan outside the transformer blocks: the embedding and the LM head split by vocabulary, and tied
parameters split alike."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_llmpar.tensor_parallel.entries import join as _join
from lightning_llmpar.tensor_parallel.param_styles import ReplicatedOnShards
from lightning_llmpar.tensor_parallel.styles import SplitLinear, VocabEmbedding

__all__ = ["check_ties", "plan_outside", "refuse_adapters", "weight_placement"]


def plan_outside(model: nn.Module, tp: int, styles: dict[str, Any], claimed: set[str], stack_prefix: str | None) -> None:
    """Outside the block stack: split the embedding and the LM head by vocabulary (``claimed``: the user's)."""

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
            if module.num_embeddings % tp:
                raise ValueError(
                    f"Embedding '{name}' has {module.num_embeddings} rows, not divisible by tensor_parallel({tp})."
                    f" Pad the vocabulary to a multiple of {tp}, or set tp_plan={{'{name}': 'replicate'}}."
                )
            styles[name] = VocabEmbedding(input_layouts=Replicate(), output_layouts=Replicate())
    for name, module in heads:
        if module.out_features == vocab and module.out_features % tp == 0:
            # The LM head: split the vocabulary and gather full logits so the user's loss is unchanged.
            styles[name] = SplitLinear("col", output=Replicate())

def check_ties(model: nn.Module, styles: dict[str, Any]) -> None:
    """Refuse a plan that splits two tied parameters differently, which would untie them."""
    owners: dict[int, tuple[str, Any]] = {}
    for name, module in model.named_modules():
        style = styles.get(name)
        for pname, param in module.named_parameters(recurse=False):
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


def refuse_adapters(model: nn.Module) -> None:
    adapters = [n for n, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    if adapters:
        raise ValueError(
            f"Module '{adapters[0]}' is a LoRA adapter (peft) around a projection; tensor parallelism does not split"
            " adapters. Fine-tune adapters with pipeline_parallel and/or data parallelism (zero_stage 0-3), which"
            " take them as they are, or merge them into the base weights first."
        )
