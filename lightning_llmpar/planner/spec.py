"""What the planner needs to know about a model: its shape and where its parameters sit.

Parameter counts come from the model itself, built on the meta device (no memory, no weights), so they are
exact for any architecture the strategy can split; widths and head counts come from its config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_llmpar.expert_parallel.apply_ep import expert_lists, find_experts
from lightning_llmpar.modeling.structure import count_attr, find_block_stack

__all__ = ["ModelSpec", "llama_spec", "model_spec", "spec_from_module"]

LITGPT_CONFIG = "model_config.yaml"  # LitGPT's own name for a model's config


@dataclass(frozen=True)
class ModelSpec:
    """A decoder LM's shape. ``block_*`` counts are per block; ``matrix`` params are the 2-D weights tensor
    parallelism splits (norms and biases stay whole); ``expert`` params are the MoE experts' (3-D) weights."""

    n_layer: int
    hidden: int
    n_head: int
    n_kv_head: int
    ffn_hidden: int  # dense MLP width, or each expert's width for MoE
    vocab: int
    block_params: int
    block_matrix_params: int
    embed_params: int  # input embedding
    head_params: int  # output head (0 when tied to the embedding)
    other_params: int  # final norm and anything else outside the blocks
    tied: bool = False
    n_expert: int = 0
    top_k: int = 1
    block_expert_params: int = 0
    # How `llmpar fit` builds this model: the YAML `model:` section the planner's config carries over.
    fit_model: dict[str, Any] = field(default_factory=dict, compare=False)
    name: str = "model"
    max_seq: int = 0  # the longest sequence the model accepts (its block_size); 0: no fixed limit

    @property
    def params(self) -> int:
        return self.n_layer * self.block_params + self.embed_params + self.head_params + self.other_params

    @property
    def active_matrix_params_per_token(self) -> float:
        """Block matrix parameters one token is multiplied by (MoE: only its ``top_k`` experts)."""
        dense = self.block_matrix_params - self.block_expert_params
        experts = self.block_expert_params * self.top_k / self.n_expert if self.n_expert else 0.0
        return self.n_layer * (dense + experts)


def spec_from_module(model: nn.Module, dims: dict[str, Any], fit_model: dict[str, Any], name: str) -> ModelSpec:
    """Count ``model``'s parameters by place (blocks, embedding, head, the rest); ``dims`` gives the widths."""
    stack = find_block_stack(model)
    if stack is None:
        raise ValueError(f"{name}: no stack of repeated blocks found; the planner splits models by their blocks.")
    blocks = stack.modules()
    # Experts with 3-D weights (transformers) or a list of MLPs (LitGPT's LLaMAMoE).
    experts = [m for block in blocks
               for m in [*find_experts(block).values(), *map(block.get_submodule, expert_lists(block))]]
    expert_ids = {id(p) for m in experts for p in m.parameters()}

    def per_block(keep: Any) -> int:  # the mean over the blocks: hybrid stacks mix block classes (Jamba)
        return round(sum(p.numel() for block in blocks for p in block.parameters() if keep(p)) / len(blocks))

    block_params, matrix = per_block(lambda p: True), per_block(lambda p: p.dim() >= 2)
    in_blocks = {id(p) for b in stack.modules() for p in b.parameters()}
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    embed_ids = {id(p) for m in embeds for p in m.parameters()}
    outside = [p for p in model.parameters() if id(p) not in in_blocks]  # parameters() yields a tied weight once
    tied = any(isinstance(m, nn.Linear) and id(m.weight) in embed_ids for m in model.modules())
    embed = sum(p.numel() for p in outside if id(p) in embed_ids)
    rest = [p for p in outside if id(p) not in embed_ids]
    head = sum(p.numel() for p in rest if p.dim() >= 2)
    return ModelSpec(
        n_layer=stack.total, hidden=dims["hidden"], n_head=dims["n_head"], n_kv_head=dims["n_kv_head"],
        ffn_hidden=dims["ffn_hidden"], vocab=dims["vocab"], block_params=block_params, block_matrix_params=matrix,
        embed_params=embed, head_params=head, other_params=sum(p.numel() for p in rest if p.dim() < 2), tied=tied,
        n_expert=dims.get("n_expert", 0), top_k=dims.get("top_k", 1),
        block_expert_params=per_block(lambda p: id(p) in expert_ids),
        fit_model=fit_model, name=name, max_seq=dims.get("max_seq", 0),
    )


def llama_spec(name: str, hidden: int, layers: int, heads: int, kv_heads: int, ffn_hidden: int, vocab: int,
               tied: bool = False, **_: Any) -> ModelSpec:
    """A Llama-architecture spec from its published dimensions, counted by formula (no model is built): per
    block q, k, v, o, gate, up, down and two RMSNorm weights; an embedding, a final norm and a head."""
    kv = kv_heads * hidden // heads
    matrix = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn_hidden
    return ModelSpec(n_layer=layers, hidden=hidden, n_head=heads, n_kv_head=kv_heads, ffn_hidden=ffn_hidden,
                     vocab=vocab, block_params=matrix + 2 * hidden, block_matrix_params=matrix,
                     embed_params=vocab * hidden, head_params=0 if tied else vocab * hidden, other_params=hidden,
                     tied=tied, name=name)


def _example_gpt(kwargs: dict[str, Any]) -> ModelSpec:
    from lightning_llmpar.models import GPTModule

    with torch.device("meta"):  # the module `llmpar fit` builds from these arguments
        model = GPTModule(**kwargs).model
    config = model.config
    dims = {"hidden": config.n_embd, "n_head": config.n_head, "n_kv_head": config.n_kv_head,
            "ffn_hidden": config.moe_hidden if config.n_expert else config.mlp_hidden, "vocab": config.vocab_size,
            "n_expert": config.n_expert, "top_k": config.n_expert_per_token if config.n_expert else 1,
            "max_seq": config.block_size}
    fit = {"class_path": "lightning_llmpar.models.GPTModule", "init_args": dict(kwargs)}
    return spec_from_module(model, dims, fit, name=f"example GPT {config.n_layer}x{config.n_embd}")


def _hf(directory: Path, init_args: dict[str, Any] | None = None) -> ModelSpec:
    from lightning_llmpar.models import HFCausalLM

    module = HFCausalLM(model=str(directory))
    with torch.device("meta"):  # the model `llmpar fit` builds from this directory
        module.configure_model()
    model = module.model
    config = model.config
    text = getattr(config, "text_config", None) or config
    n_head = getattr(text, "num_attention_heads", None)
    if not n_head:
        raise ValueError(
            f"{directory}: {config.model_type} has no attention heads (num_attention_heads); the planner's activation"
            " and step-time models are those of attention transformers. Choose a layout by hand (docs/layouts.md)."
        )
    n_expert = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 0
    ffn = getattr(text, "moe_intermediate_size", None) if n_expert else None
    dims = {"hidden": text.hidden_size, "n_head": n_head,
            "n_kv_head": count_attr(text, "num_key_value_heads") or n_head,  # Gemma 4's varies by layer
            "ffn_hidden": ffn or getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
            "vocab": text.vocab_size, "n_expert": n_expert,
            "top_k": getattr(text, "num_experts_per_tok", 1) if n_expert else 1}
    fit = {"class_path": "lightning_llmpar.models.HFCausalLM", "init_args": init_args or {"model": str(directory)}}
    return spec_from_module(model, dims, fit, name=f"{config.model_type} ({directory})")


def _litgpt(directory: Path, init_args: dict[str, Any] | None = None) -> ModelSpec:
    from litgpt import Config
    from litgpt.model import GPT

    config = Config.from_file(directory / LITGPT_CONFIG)
    with torch.device("meta"):  # the model LitGPTModule builds from this directory
        model = GPT(config)
    n_expert = config.n_expert or 0
    dims = {"hidden": config.n_embd, "n_head": config.n_head, "n_kv_head": config.n_query_groups,
            "ffn_hidden": (config.moe_intermediate_size or config.intermediate_size) if n_expert
            else config.intermediate_size, "vocab": config.padded_vocab_size, "n_expert": n_expert,
            "top_k": config.n_expert_per_token if n_expert else 1, "max_seq": config.block_size}
    fit = {"class_path": "lightning_llmpar.models.LitGPTModule", "init_args": init_args or {"model": str(directory)}}
    return spec_from_module(model, dims, fit, name=f"LitGPT {config.name} ({directory})")


def model_spec(source: str | Path | dict[str, Any]) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face config directory (or its config.json), a LitGPT checkpoint directory (or
    its model_config.yaml), a `llmpar fit` YAML (its ``model:`` section: the example GPT's arguments, or an
    HFCausalLM's or LitGPTModule's directory), or a dict of the example GPT's arguments."""
    if isinstance(source, dict):
        return _example_gpt(source)
    path = Path(source)
    if path.name == LITGPT_CONFIG and path.is_file():  # LitGPT's, also where transformers' config.json is beside it
        return _litgpt(path.parent)
    if path.name == "config.json":
        path = path.parent
    if path.is_dir():
        if (path / "config.json").is_file():
            return _hf(path)
        if (path / LITGPT_CONFIG).is_file():
            return _litgpt(path)
        raise ValueError(f"{path} holds no config.json or {LITGPT_CONFIG}: give a Hugging Face model directory, a"
                         " LitGPT checkpoint directory or a llmpar fit YAML.")
    if path.suffix in (".yaml", ".yml") and path.is_file():
        import yaml

        try:
            config = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:  # one line naming the file and where, not the parser's traceback
            raise ValueError(f"{path} is not valid YAML: {' '.join(str(err).split())}. Fix the file.") from None
        if not (isinstance(config, dict) and {"trainer", "model", "data"} & set(config)):
            # e.g. a model's own config, which would otherwise read as the default example GPT
            found = ", ".join(map(str, list(config)[:5])) if isinstance(config, dict) else type(config).__name__
            raise ValueError(f"{path}: not a llmpar fit YAML (no trainer, model or data section; it has {found})."
                             f" Give a fit config, a Hugging Face config directory or a LitGPT {LITGPT_CONFIG}.")
        section = config.get("model") or {}
        class_path = section.get("class_path", "lightning_llmpar.models.GPTModule")
        args = section.get("init_args", section if "class_path" not in section else {})
        name = class_path.split(".")[-1]
        if name in ("HFCausalLM", "LitGPTModule"):
            directory = Path(args["model"])
            if not directory.is_dir():
                raise ValueError(f"{path}: its model directory {str(directory)!r} does not exist here ({Path.cwd()});"
                                 " relative paths are read from the current folder, as `llmpar fit` reads them.")
            # The fit config's own arguments (learning rate, schedule) go on to the planned config.
            return (_hf if name == "HFCausalLM" else _litgpt)(directory, dict(args))
        if name != "GPTModule":
            raise ValueError(
                f"{path}: the planner reads the arguments of the example GPT, HFCausalLM or LitGPTModule, not"
                f" {class_path}. Give the model's Hugging Face config directory or LitGPT checkpoint instead."
            )
        return _example_gpt(dict(args))
    raise ValueError(
        f"model {str(source)!r}: not a Hugging Face config directory, a config.json, a LitGPT checkpoint directory"
        " (or its model_config.yaml) or a llmpar fit YAML"
        " (nothing by that name exists)." if not path.exists() else f"model {str(source)!r}: unknown kind of file."
    )

