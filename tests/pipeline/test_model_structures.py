"""Models outside the Llama mould: block stacks of containers, forwards that zip per-layer lists with the blocks,
forwards that break the pipeline's assumptions (refused before work), and a LitGPT checkpoint read per rank.

All cases of one world size run inside one launch of the ranks; each one-process reference runs once.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.distributed import run_ranks
from tests.zoo import assert_exact, fit_cases, save_litgpt

HAS_LITGPT = importlib.util.find_spec("litgpt") is not None
BATCH = 8
PP2 = {"pipeline_parallel": 2}
NANO_WHOLE = {"tensor_parallel": 2, "sequence_parallel": False,
              "tp_plan": {"transformer.h.*.attn.c_attn": "replicate", "transformer.h.*.attn.c_proj": "replicate"}}

# (model, strategy kwargs): exact vs one process.
EXACT = [
    *[("containers", {"zero_stage": z}) for z in (0, 1, 2, 3)],  # FSDP2 units: the containers' children
    ("containers", {"tensor_parallel": 2}),
    ("zipped", PP2),  # blocks paired with a per-layer list by position
    ("zipped", {**PP2, "block_stack": "layers"}),
    ("zipped", {"tensor_parallel": 2}),
    # The split check ran the step before the optimizers existed: self.optimizers() failed in it.
    ("reads_its_optimizer", PP2),
    # layers[i] for i in range(len(layers)): a stage reaches the blocks before its window as pass-throughs, as
    # iteration does (it failed on the second rank with KeyError: '0')
    ("indexed", PP2),
    # Blocks return (output, state), found by running the model whole (the meta device cannot run them); a stage
    # starting at a block that makes its own state gets a pass-through's (activation, None).
    ("passes_state", {**PP2, "pipeline_schedule": "1F1B"}),
    # Every block reads the embeddings (through a scale initialized to zero: only gradients show it): the embedding
    # runs on every rank, its gradient summed, under a schedule with one stage per rank.
    ("reads_embedding", {**PP2, "pipeline_schedule": "1F1B"}),
    ("reads_gated_embedding", {**PP2, "pipeline_schedule": "GPipe"}),
    ("titan_untied", {**PP2, "block_stack": "model.layers"}),  # a ModuleDict stack, named
    # Blocks in an nn.Sequential the forward calls whole (minimal GPTs): refused as "no stack" under TP and PP.
    *[("sequential", kw) for kw in ({"tensor_parallel": 2}, PP2, {**PP2, "pipeline_schedule": "1F1B"})],
    # nanoGPT's fused c_attn split by heads where the attention reshapes with its own width; kept whole by the plan
    # the refusal below names where it reads the width from its input.
    ("nanogpt_own_width", {"tensor_parallel": 2}),
    ("nanogpt", NANO_WHOLE),
]
# (model, strategy kwargs, words the ValueError must contain): refused before the first step.
REFUSED = [
    ("containers", PP2, ["containers without a forward", "block_stack="]),
    # A parameter on the model beside its blocks (learned positions): the split check blamed the blocks for reading
    # values computed before the stack.
    ("own_positions", PP2, ["holds parameters of its own (pos)", "nn.Embedding", "pipeline_parallel=1"]),
    ("reuses_embedding", PP2, ["stage 1", "computes something else", "pipeline_split_points"]),
    ("unchained", PP2, ["stage 1", "block_stack="]),
    ("passes_state", PP2, ["stage 1", "fails when run on its own", "pipeline_split_points"]),  # starts at a shared block
    ("looped", PP2, ["calls block 1", "2 times", "pipeline_parallel=1"]),  # a recurrent-depth forward
    # The step calls an ordinary model twice: the message blamed a looped model and advised dropping the pipeline.
    ("called_twice", PP2, ["runs the whole block stack 'layers' 2 times", "Concatenate the inputs into one batch"]),
    # ... which several stages per rank (the default interleaved schedule) cannot share.
    ("reads_embedding", PP2, ["'emb'", "run on every pipeline rank", "pipeline_schedule='1F1B'"]),
    ("reads_gated_embedding", PP2, ["run on every pipeline rank", "pipeline_schedule='1F1B'"]),  # gradients show it
    ("zipped", {**PP2, "block_stack": "nope"}, ["block_stack='nope'", "names no module"]),
    ("zipped", {**PP2, "block_stack": "head"}, ["block_stack='head'", "nn.ModuleList"]),
    # nanoGPT reads its width from its input (C = x.size(-1)) while a rank holds half the heads: the reshape failed
    # at the first step.
    ("nanogpt", {"tensor_parallel": 2}, ["reads its width from its input", "self.n_embd // self.n_head", "replicate"]),
    # q/k/v kept whole, the output projection split by heads: a matmul's shapes failed at the first step.
    ("nanogpt_own_width", {**NANO_WHOLE, "tp_plan": {"transformer.h.*.attn.c_attn": "replicate"}},
     ["keeps ['transformer.h.0.attn.c_attn'] whole", "splits ['transformer.h.0.attn.c_proj']", "same style"]),
]


def _per_rank(kwargs: dict[str, Any]) -> int:
    return BATCH * kwargs.get("tensor_parallel", 1) * kwargs.get("pipeline_parallel", 1) // 2


@pytest.fixture(scope="module")
def litgpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    if not HAS_LITGPT:
        return None
    out = tmp_path_factory.mktemp("litgpt") / "ckpt"
    save_litgpt("litgpt_qwen3", str(out))
    # The same weights with another rotary base, its norm_eps written as YAML 1.1 reads it (text): only the base
    # differs from the model's (it was loaded without a word; only shapes were compared).
    other = out.parent / "other_rope"
    shutil.copytree(out, other)
    config = yaml.safe_load((other / "model_config.yaml").read_text())
    config.update(rope_base=12345, norm_eps=f"{config['norm_eps']:.0e}")
    (other / "model_config.yaml").write_text(yaml.safe_dump(config))
    return out


@pytest.fixture(scope="module")
def runs(litgpt_dir: Path | None) -> tuple[dict, dict]:
    names = ("containers", "zipped", "indexed", "passes_state", "reads_embedding", "reads_gated_embedding", "titan_untied",
             "sequential", "nanogpt", "nanogpt_own_width", "reads_its_optimizer")
    refs = [(m, None, BATCH) for m in names]
    cases = [(m, kw, _per_rank(kw)) for m, kw in EXACT] + [(m, kw, _per_rank(kw)) for m, kw, _ in REFUSED]
    if litgpt_dir is not None:
        # A LitGPT checkpoint (fused qkv, q/k norms) read per rank into a model built on the meta device.
        refs.append(("litgpt_qwen3", None, BATCH, {"litgpt_pretrained": str(litgpt_dir), "tag": "ckpt-ref"}))
        for tag, kw in (("ckpt-tp2", {"tensor_parallel": 2}), ("ckpt-pp2", PP2)):
            cases.append(("litgpt_qwen3", kw, _per_rank(kw), {"litgpt_pretrained": str(litgpt_dir), "meta": True, "tag": tag}))
        cases.append(("litgpt_qwen3", PP2, _per_rank(PP2),
                      {"litgpt_pretrained": str(litgpt_dir.parent / "other_rope"), "meta": True, "tag": "ckpt-other"}))
    reference = run_ranks(fit_cases, 1, refs, timeout=600)[0]
    return reference, run_ranks(fit_cases, 2, cases, timeout=1200)


@pytest.mark.parametrize(("model", "kwargs"), EXACT, ids=[f"{m}-{kw}" for m, kw in EXACT])
def test_exact_vs_one_process(model: str, kwargs: dict[str, Any], runs: tuple[dict, dict]) -> None:
    reference, outs = runs
    sharded = kwargs.get("zero_stage", 3) >= 2 or kwargs.get("tensor_parallel", 1) > 1 or "pipeline_parallel" in kwargs
    assert_exact(reference[(model, "None")], [o[(model, repr(kwargs))] for o in outs], sharded=sharded)


@pytest.mark.parametrize(("model", "kwargs", "words"), REFUSED, ids=[f"{m}-{kw}" for m, kw, _ in REFUSED])
def test_refused_before_work(model: str, kwargs: dict[str, Any], words: list[str], runs: tuple[dict, dict]) -> None:
    for out in runs[1]:
        error = out[(model, repr(kwargs))].get("error", "")
        message = error.strip().splitlines()[-1] if error else "(trained without an error)"
        assert message.startswith("ValueError"), message
        for word in words:
            assert word in message, message
        assert "llm_parallel.py\", line" in error and ", in setup\n" in error, "raised while setting up, before any step"


@pytest.mark.skipif(not HAS_LITGPT, reason="litgpt is not installed (pip install --no-deps litgpt)")
@pytest.mark.parametrize("tag", ["ckpt-tp2", "ckpt-pp2"])
def test_litgpt_checkpoint_loads_per_rank(tag: str, runs: tuple[dict, dict]) -> None:
    reference, outs = runs
    assert_exact(reference[("litgpt_qwen3", "ckpt-ref")], [o[("litgpt_qwen3", tag)] for o in outs])


@pytest.mark.skipif(not HAS_LITGPT, reason="litgpt is not installed (pip install --no-deps litgpt)")
def test_litgpt_checkpoint_of_another_config_is_refused(runs: tuple[dict, dict]) -> None:
    for out in runs[1]:
        error = out[("litgpt_qwen3", "ckpt-other")].get("error", "(trained without an error)")
        assert "model_config.yaml has rope_base=12345 but the model has 1000000" in error, error
        assert "norm_eps" not in error and ", in setup\n" in error  # the same value as text; before any step


def test_module_dict_stacks_are_found_and_dicts_of_single_layers_are_not() -> None:
    from torch import nn

    from lightning_llmpar.modeling.structure import block_at, find_block_stack, mark_block_stack
    from tests.titan_models import Transformer, TransformerModelArgs

    model = Transformer(TransformerModelArgs())
    stack = find_block_stack(model)
    assert stack is not None and stack.prefix == "layers" and isinstance(stack.blocks, nn.ModuleDict)
    assert stack.keys() == ["0", "1", "2", "3"] and block_at(stack.blocks, 2) is model.layers["2"]
    # A dict of single layers (per-task heads, peft's lora_A) is not a stack of blocks.
    heads = nn.Module()
    heads.heads = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    assert find_block_stack(heads) is None
    holder = nn.Module()
    holder.layers = nn.ModuleDict()
    with pytest.raises(ValueError, match="block_stack='layers' is an empty ModuleDict"):
        mark_block_stack(holder, "layers")


def test_sequential_stacks_are_found_and_chains_of_single_layers_are_not() -> None:
    from torch import nn

    from lightning_llmpar.modeling.structure import find_block_stack
    from tests.custom_models import SequentialStack

    model = SequentialStack()
    stack = find_block_stack(model)
    assert stack is not None and stack.prefix == "blocks" and stack.keys() == ["0", "1", "2", "3"]
    # An MLP's Sequential(Linear, GELU, Linear), a chain of Linears, or a Sequential subclass with its own forward
    # (which may not call its children in order) is not a stack of blocks.
    chains = nn.Module()
    chains.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    chains.deep = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    assert find_block_stack(chains) is None

    class Reversed(nn.Sequential):
        def forward(self, x):  # type: ignore[no-untyped-def]
            for block in reversed(self):
                x = block(x)
            return x

    model.blocks = Reversed(*model.blocks)
    assert find_block_stack(model) is None


def test_a_stand_in_gives_the_weights_of_submodules_for_their_dtype_and_shape() -> None:
    # ViT's forward reads embeddings.patch_embeddings.projection.weight.dtype: the stand-in served only its own
    # parameters, and the failed read was taken for the blocks reading the embeddings (interleaved pp2 refused).
    import torch
    from torch import nn

    from lightning_llmpar.pipeline.split import _StandIn

    embeddings = nn.Module()
    embeddings.patch = nn.Module()
    embeddings.patch.projection = nn.Conv2d(3, 8, 4)
    embeddings.register_buffer("position_ids", torch.arange(5))
    stand_in = _StandIn(embeddings, "embeddings", True, nn.ModuleList([nn.Linear(2, 2)]))
    weight = stand_in.patch.projection.weight
    assert weight.dtype == torch.float32 and weight.shape == (8, 3, 4, 4) and weight.stride() == (0, 0, 0, 0)
    assert stand_in.patch.projection.out_channels == 8
    with pytest.raises(AttributeError):  # a buffer's values are another stage's: zeros would be wrong positions
        stand_in.position_ids  # noqa: B018
