"""Every configuration a user can get wrong fails early with a ValueError that names the values and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from lightning_llmpar import LLMParallelStrategy, ParallelLayout
from lightning_llmpar.models import GPT, GPTConfig
from lightning_llmpar.tensor_parallel import infer_tp_plan


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"zero_stage": 4}, r"`zero_stage` must be one of \(0, 1, 2, 3\), got 4"),
        ({"tensor_parallel": 0}, r"`tensor_parallel` must be a positive integer, got 0"),
        ({"data_parallel": -2}, r"`data_parallel` must be a positive integer or 'auto', got -2"),
        ({"pipeline_parallel": 2, "zero_stage": 3, "pipeline_schedule": "ZBVZeroBubble"}, r"ZBVZeroBubble.*zero_stage=3 gives wrong gradients"),
        ({"pipeline_parallel": 2, "zero_stage": 3, "pipeline_schedule": "DualPipeV"}, r"DualPipeV.*zero_stage=3 gives wrong gradients"),
        ({"pipeline_parallel": 2, "zero_stage": 3, "pipeline_schedule": "InterleavedZeroBubble"}, r"zero_stage=3 gives wrong"),
        ({"pipeline_parallel": 2, "pipeline_schedule": "Zigzag"}, r"pipeline_schedule='Zigzag' is not one of"),
        ({"pipeline_parallel": 2, "pipeline_schedule": "1F1B", "pipeline_virtual_stages": 2}, r"runs 1 stage\(s\) per rank"),
        ({"pipeline_parallel": 2, "pipeline_virtual_stages": 1}, r"pipeline_virtual_stages=1 must be >= 2"),
        ({"pipeline_parallel": 4, "pipeline_microbatches": 2}, r"pipeline_microbatches=2 is smaller than pipeline_parallel=4"),
        ({"cpu_offload": True}, r"cpu_offload=True needs sharded state.*zero_stage to 1, 2 or 3"),
        ({"start_method": "thread"}, r"`start_method` must be one of"),
        ({"tp_plan": ["q_proj"]}, r"`tp_plan` must map module-name patterns"),
        # Style names are checked where the strategy is built, also for a pattern that would match nothing.
        ({"tensor_parallel": 2, "tp_plan": {"model.layers.*.mlp.up": "colwize"}},
         r"tp_plan\['model.layers.\*.mlp.up'\] = 'colwize' is not a known style. Use one of \['colwise'"),
        ({"tensor_parallel": 2, "tp_plan": {3: "colwise"}}, r"tp_plan keys are module-name patterns .* got 3"),
        # Split points of another type, or too few for the stages, ran or failed only after the processes started.
        ({"pipeline_parallel": 2, "pipeline_split_points": "2"}, r"pipeline_split_points='2' must be a list of 3"),
        ({"pipeline_parallel": 2, "pipeline_split_points": [2.5, 3, 4]}, r"strictly increasing block indices >= 1"),
        ({"pipeline_parallel": 2, "pipeline_split_points": [2]}, r"\[2\] must be a list of 3 .* e.g. \[1, 2, 3\]"),
        ({"process_group_backend": "glo"}, r"`process_group_backend` must be None .* got 'glo'"),
    ],
)
def test_strategy_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLMParallelStrategy(**kwargs)


@pytest.mark.parametrize(
    ("devices", "kwargs", "match"),
    [
        (3, {"tensor_parallel": 2}, r"world_size\(3\) is not divisible by tensor_parallel\(2\) \* pipeline_parallel\(1\)"),
        (2, {"data_parallel": 4}, r"dp_replicate\(4\) \* dp_shard\(1\) \* cp\(1\) \* tp\(1\) \* pp\(1\) = 4 != world_size\(2\)"),
        (4, {"zero_stage": 3, "data_parallel_replicate": 3}, r"data_parallel_replicate\(3\) must be a positive divisor"),
        (2, {"zero_stage": 0, "data_parallel_replicate": 1}, r"zero_stage=0 replicates parameters"),
    ],
)
def test_layout_is_checked_when_the_trainer_is_built(devices: int, kwargs: dict, match: str) -> None:
    # Raised in Trainer(...), before any process is launched or any process group exists.
    with pytest.raises(ValueError, match=match):
        Trainer(accelerator="cpu", devices=devices, strategy=LLMParallelStrategy(**kwargs), logger=False)
    assert not torch.distributed.is_initialized()


def test_layout_object_names_every_degree() -> None:
    layout = ParallelLayout.from_degrees(8, tensor_parallel=2, zero_stage=3, data_parallel_replicate=2)
    assert (layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp) == (2, 2, 2, 1)
    assert layout.dp == 4
    with pytest.raises(ValueError, match=r"dp_replicate\(1\) \* dp_shard\(2\) \* cp\(1\) \* tp\(2\) \* pp\(1\) = 4 != world_size\(8\)"):
        ParallelLayout(world_size=8, dp_shard=2, tp=2, zero_stage=3)


def _gpt(**overrides: int) -> GPT:
    cfg = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


def test_heads_not_divisible_by_tp() -> None:
    # Key/value heads fewer than the ranks are shared when the degree is a multiple of them (2 at tp4), not otherwise.
    with pytest.raises(ValueError, match=r"Attention module 'layers.0.attn': n_kv_head = 3 is not divisible by tensor_parallel\(2\)"):
        infer_tp_plan(_gpt(n_head=6, n_kv_head=3, n_embd=48), 2)
    assert type(infer_tp_plan(_gpt(), 4).styles["layers.0.attn.k_proj"]).__name__ == "SharedKVHeads"
    with pytest.raises(ValueError, match=r"n_head = 4 is not divisible by tensor_parallel\(3\)"):
        infer_tp_plan(_gpt(vocab_size=66), 3)


def test_vocabulary_not_divisible_by_tp_is_split_unevenly() -> None:
    # GPT-2's 50257 tokens: DTensor shards the rows unevenly (the first ranks hold one more), exact without padding.
    plan = infer_tp_plan(_gpt(vocab_size=65), 2)
    assert type(plan.styles["tok_emb"]).__name__ == "VocabEmbedding" and plan.styles["lm_head"].kind == "col"


class _FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)


class _OddBlock(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.attn = _FusedAttention() if fused else nn.Identity()
        self.router = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x) + self.router(x).sum(-1, keepdim=True)


class _Stack(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_OddBlock(fused) for _ in range(2))


def test_fused_qkv_is_named_with_the_fix() -> None:
    # An unknown attention class: the layout of its fused projection is asked for, with both ways to say it.
    with pytest.raises(ValueError, match=r"Module 'blocks.0.attn.qkv' fuses q, k and v.*'style': 'colwise', 'sizes': \[q_rows, k_rows, v_rows\].*tp_plan=\{'blocks.0.attn.qkv': 'colwise'\}"):
        infer_tp_plan(_Stack(fused=True), 2, sequence_parallel=False, user_plan={"blocks.*.router": "replicate"})
    plan = infer_tp_plan(_Stack(fused=True), 2, sequence_parallel=False,
                         user_plan={"blocks.*.router": "replicate", "blocks.*.attn.qkv": {"sizes": [16, 16, 16]}})
    assert plan.packings["blocks.0.attn.qkv.weight"].sizes == (16, 16, 16)
    with pytest.raises(ValueError, match=r"sizes \[16, 16\] add up to 32, but the weight has 48 along dim 0"):
        infer_tp_plan(_Stack(fused=True), 2, user_plan={"blocks.*.attn.qkv": {"sizes": [16, 16]}})


def test_unknown_linear_on_the_hidden_state_is_kept_whole() -> None:
    # A Linear of no known role on the block, outside attention and MLP (Gemma 4's per-layer input gate): kept
    # whole, which is exact on the replicated hidden state; on token shards it is not, so sequence parallelism
    # goes off with a note naming it.
    plan = infer_tp_plan(_Stack(fused=False), 2)
    assert not plan.sequence_parallel and "'blocks.0.router' is a Linear outside attention and MLP" in plan.notes[0]
    assert plan.styles.get("blocks.0.router") is None


def test_explicit_plan_covers_what_inference_cannot() -> None:
    from lightning_llmpar.tensor_parallel.entries import check_plan_matches

    plan = infer_tp_plan(_Stack(fused=False), 2, sequence_parallel=False, user_plan={"blocks.*.router": "replicate"})
    assert plan.styles["blocks.0.router"] is None
    check_plan_matches(_Stack(fused=False), {"blocks.*.router": "replicate", "blocks.1.attn": "replicate"})
    # A misspelt pattern would leave the module it meant to the inferred plan: refused, with the names nearest to it.
    with pytest.raises(ValueError, match=r"tp_plan pattern 'blocks.\*.routr' matches no module of _Stack .*"
                                         r"Nearest module names: \['blocks.1.router', 'blocks.0.router'"):
        check_plan_matches(_Stack(fused=False), {"blocks.*.router": "replicate", "blocks.*.routr": "replicate"})
    with pytest.raises(ValueError, match=r"tp_plan\['blocks.\*.router'\] = 'diagonal' is not a known style"):
        infer_tp_plan(_Stack(fused=False), 2, user_plan={"blocks.*.router": "diagonal"})


class _HeadScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


def test_whole_parameters_on_sharded_activations() -> None:
    # With sequence parallelism a replicated layer outside attention/MLP would see only this rank's tokens:
    # sequence parallelism is turned off for the model, with a note saying why.
    plan = infer_tp_plan(_Stack(fused=False), 2, user_plan={"blocks.*.router": "replicate"})
    assert not plan.sequence_parallel
    assert "'blocks.0.router'" in plan.notes[0] and "sequence parallelism turned off" in plan.notes[0]
    # A parameter inside attention that is neither a projection nor a norm sees only this rank's heads.
    model = _gpt()
    for layer in model.layers:
        layer.attn.extra = _HeadScale()
    for seq in (True, False):
        with pytest.raises(ValueError, match=r"Module 'layers.0.attn.extra' holds parameters inside the tensor-parallel region 'layers.0.attn'"):
            infer_tp_plan(model, 2, sequence_parallel=seq)


def test_plan_order_does_not_depend_on_the_hash_seed() -> None:
    # Sharding a parameter is a collective: every rank must walk the plan in the same order,
    # also when ranks are separate interpreters with different string hashing.
    import os
    import subprocess
    import sys

    code = (
        "from tests.workloads import make_gpt; from lightning_llmpar.tensor_parallel import infer_tp_plan;"
        "print(list(infer_tp_plan(make_gpt(), 2).styles))"
    )
    orders = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2", "3")
    }
    assert len(orders) == 1


def test_model_without_block_stack() -> None:
    with pytest.raises(ValueError, match=r"Could not find a stack of transformer blocks.*in Sequential"):
        infer_tp_plan(nn.Sequential(nn.Linear(4, 4)), 2)


def test_tied_embedding_and_head_split_alike_or_refused() -> None:
    model = _gpt()
    model.lm_head.weight = model.tok_emb.weight
    plan = infer_tp_plan(model, 2)  # both split by vocabulary: one sharded weight serves both
    assert plan.styles["tok_emb"] is not None and plan.styles["lm_head"] is not None
    # An explicit plan that keeps only one side whole would untie them: refused before anything is split.
    with pytest.raises(ValueError, match=r"'lm_head.weight' is tied to 'tok_emb.weight'.*untie them.*'tok_emb': 'replicate', 'lm_head': 'replicate'"):
        infer_tp_plan(model, 2, user_plan={"lm_head": "replicate"})


def test_registered_names() -> None:
    import lightning_llmpar  # noqa: F401 - registration happens at import

    trainer = Trainer(accelerator="cpu", devices=1, strategy="llmpar_fsdp", logger=False)
    assert isinstance(trainer.strategy, LLMParallelStrategy)
    assert trainer.strategy.layout.zero_stage == 3
    trainer = Trainer(accelerator="cpu", devices=1, strategy="llmpar_tp", logger=False)
    assert trainer.strategy.layout.tp == 1


class _ParamActivation(nn.Module):
    """An activation with a learned scale (as xIELU has): elementwise, so it runs on this rank's features."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha * torch.nn.functional.silu(x)


def test_parameters_an_mlp_applies_to_its_split_features() -> None:
    # Inside an MLP, between its column and row splits: whole parameters on this rank's features (last dim),
    # checked against the local widths the projections give.
    model = _gpt()
    for layer in model.layers:
        layer.mlp.act = _ParamActivation()
    style = infer_tp_plan(model, 2).styles["layers.0.mlp.act"]
    assert type(style).__name__ == "ReplicatedOnShards" and style.from_end == 1
    assert style.widths == frozenset({model.layers[0].mlp.down_proj.in_features // 2})
    # Attention's own parameters beside its projections: one value per query head (GPT-OSS's sinks) split by
    # heads; anything else refused with the fix.
    model = _gpt()
    for layer in model.layers:
        layer.attn.sinks = nn.Parameter(torch.zeros(4))
    assert type(infer_tp_plan(model, 2).styles["layers.0.attn#own"]).__name__ == "OwnPerHead"
    for layer in model.layers:
        layer.attn.sinks = nn.Parameter(torch.zeros(3))
    words = r"'layers.0.attn' holds parameter 'sinks' itself.*not one value per query or key/value head.*pipeline_parallel"
    with pytest.raises(ValueError, match=words):
        infer_tp_plan(model, 2)


def _call_on_the_whole_input() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_llmpar.tensor_parallel.param_styles import ReplicatedOnShards

    act = parallelize_module(_ParamActivation(), init_device_mesh("cpu", (1,)), ReplicatedOnShards(1, frozenset({8})))
    act(torch.randn(2, 8))  # this rank's features
    try:
        act(torch.randn(2, 32))  # something else: the parameter's gradient would be wrong
    except ValueError as err:
        return str(err)
    return "not refused"


def test_a_parameter_called_on_something_else_than_the_split_features_is_refused() -> None:
    from tests.distributed import run_ranks

    message = run_ranks(_call_on_the_whole_input, 1)[0]
    assert "called on 32 features, not on this rank's share of the MLP's width ([8])" in message, message


class _Ungated(nn.Module):
    """An MLP without a gate whose up projection carries a fused [gate; up] name (Granite's input_linear)."""

    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.input_linear = nn.Linear(8, 32)
        self.output_linear = nn.Linear(16 if gated else 32, 8)


def test_fused_up_name_is_split_in_halves_only_when_the_down_projection_reads_half() -> None:
    from lightning_llmpar.tensor_parallel.families import name_roles

    assert name_roles(dict(_Ungated(gated=True).named_children()))["input_linear"] == "gate_up"
    # Halves split apart would hand the down projection's rows features of the wrong rank.
    assert name_roles(dict(_Ungated(gated=False).named_children()))["input_linear"] == "col"


def _mamba2(**overrides: object) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4, num_heads=8, head_dim=8, chunk_size=8)
    return transformers.AutoModelForCausalLM.from_config(transformers.Mamba2Config(**{**sizes, **overrides}))


def test_state_space_mixers_split_by_heads_and_groups() -> None:
    from lightning_llmpar.tensor_parallel.param_styles import ShardedNorm

    plan = infer_tp_plan(_mamba2(n_groups=2), 2)
    # in_proj packs [gate, x, B, C, dt]; the depthwise conv [x, B, C]: each rank its heads' and groups' share.
    assert plan.packings["backbone.layers.0.mixer.in_proj.weight"].sizes == (64, 64, 8, 8, 8)
    assert plan.packings["backbone.layers.0.mixer.conv1d.weight"].sizes == (64, 8, 8)
    assert plan.local_counts["backbone.layers.0.mixer"] == {"num_heads": 4, "n_groups": 1, "intermediate_size": 32,
                                                             "conv_dim": 40}
    assert plan.styles["backbone.layers.0.mixer#params"].groups is None
    # One group shared by both ranks' heads: stored split the same way, the mixer sees the group's B and C whole
    # (4 state features each) and the gated norm's statistic spans the ranks.
    shared = infer_tp_plan(_mamba2(n_groups=1), 2)
    assert shared.packings["backbone.layers.0.mixer.in_proj.weight"].sizes == (64, 64, 4, 4, 8)
    assert shared.local_counts["backbone.layers.0.mixer"] == {"num_heads": 4, "n_groups": 1, "intermediate_size": 32,
                                                               "conv_dim": 40}
    assert shared.styles["backbone.layers.0.mixer#params"].groups.state == 4
    assert isinstance(shared.styles["backbone.layers.0.mixer.norm"], ShardedNorm)
    # Three groups over two ranks: a rank's heads would straddle groups.
    with pytest.raises(ValueError, match=r"Mixer 'backbone.layers.0.mixer'.*3 head groups and tensor_parallel\(2\)"):
        infer_tp_plan(_mamba2(n_groups=3, num_heads=12, hidden_size=48), 2)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.up_proj(x))


class _OtherMlp(_Mlp):
    pass


class _Tower(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Mlp() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList([_Tower(2), type("_Decoder", (_Tower,), {})(3)])


def test_block_stack_of_mixed_classes() -> None:
    from lightning_llmpar.modeling.structure import find_block_stack

    # Hybrid models interleave block classes (Jamba: attention and Mamba layers), each repeated: one stack.
    hybrid = nn.Module()
    hybrid.layers = nn.ModuleList([_Mlp(), _OtherMlp(), _Mlp(), _OtherMlp()])
    assert find_block_stack(hybrid).prefix == "layers"
    # Distinct sub-models, one of each class, are not blocks: the biggest list inside them is the stack.
    assert find_block_stack(_EncoderDecoder()).prefix == "parts.1.layers"


class _DeltaMixer(nn.Module):
    """A gated delta-rule mixer by its parts' names, with a low-rank gate shared by every head (as Kimi's)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_k_heads = self.num_v_heads = 2
        self.head_k_dim = self.head_v_dim = 4
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, 8, bias=False) for _ in range(3))
        self.conv1d = nn.Conv1d(24, 24, 4, groups=24, bias=False)
        self.A_log, self.dt_bias = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
        self.g_a_proj, self.g_b_proj = nn.Linear(8, 4, bias=False), nn.Linear(4, 8, bias=False)
        self.o_proj = nn.Linear(8, 8, bias=False)


def test_a_delta_rule_mixer_with_a_projection_not_split_by_heads_is_refused() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList(_DeltaMixer() for _ in range(2))
    with pytest.raises(ValueError, match=r"'layers.0' \(_DeltaMixer\).*projection 'g_a_proj' that tensor parallelism cannot split by heads"):
        infer_tp_plan(model, 2)
    for layer in model.layers:
        del layer.g_a_proj, layer.g_b_proj
    plan = infer_tp_plan(model, 2)  # q/k/v by heads, the convolution over [q; k; v] per piece
    assert plan.packings["layers.0.conv1d.weight"].sizes == (8, 8, 8)
    assert plan.local_counts["layers.0"]["num_v_heads"] == 1


def _latent(cls: str, **overrides: object) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                 qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    config = getattr(transformers, cls)(**{**sizes, **overrides})
    return transformers.AutoModelForCausalLM.from_config(config)


def test_latent_attention_splits_by_heads_with_its_latents_whole() -> None:
    from lightning_llmpar.tensor_parallel.mla import SharedRotaryKey
    from lightning_llmpar.tensor_parallel.styles import SplitLinear

    plan = infer_tp_plan(_latent("DeepseekV3Config"), 2)
    attn = "model.layers.0.self_attn"
    kinds = {n: s.kind for n in ("q_b_proj", "kv_b_proj", "o_proj") if isinstance(s := plan.styles[f"{attn}.{n}"], SplitLinear)}
    assert kinds == {"q_b_proj": "col", "kv_b_proj": "col", "o_proj": "row"}
    # The rotary key every head shares gets its gradient summed; the down projections and norms stay plain.
    assert plan.styles[f"{attn}.kv_a_proj_with_mqa"].width == 4
    assert isinstance(plan.styles[f"{attn}.kv_a_proj_with_mqa"], SharedRotaryKey)
    assert not any(plan.styles.get(f"{attn}.{n}") for n in ("q_a_proj", "q_a_layernorm", "kv_a_layernorm"))
    assert plan.local_counts[attn]["num_heads"] == 2
    assert infer_tp_plan(_latent("DeepseekV3Config", q_lora_rank=None), 2).styles[f"{attn}.q_proj"].kind == "col"
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn' \(DeepseekV3Attention\): 4 heads not divisible"):
        infer_tp_plan(_latent("DeepseekV3Config"), 8)
    with pytest.raises(ValueError, match=r"tp_plan names 'model.layers.0.self_attn.q_b_proj'.*multi-head latent attention"):
        infer_tp_plan(_latent("DeepseekV3Config"), 2, user_plan={f"{attn}.q_b_proj": "colwise"})
    # A sparse-attention indexer (no gradients) runs whole beside the split heads.
    sparse = infer_tp_plan(_latent("DeepseekV32Config"), 2)
    assert sparse.styles[f"{attn}.kv_b_proj"].kind == "col"
    assert not any(n.startswith(f"{attn}.indexer") for n, style in sparse.styles.items() if style is not None)
    # A part the split does not know (a per-head gate, as HY-V4 and dots3 have): the attention is kept whole.
    gated = _latent("DeepseekV3Config")
    for layer in gated.model.layers:
        layer.self_attn.g_proj = nn.Linear(32, 4, bias=False)
    whole = infer_tp_plan(gated, 2)
    assert all(whole.styles[n] is None for n in whole.styles if n.startswith(attn + ".") or n == attn)


def test_lightning_and_kimi_delta_attention_split_by_heads() -> None:
    transformers = pytest.importorskip("transformers")
    from tests.zoo import make_config

    minimax = infer_tp_plan(transformers.AutoModelForCausalLM.from_config(make_config("minimax")), 2)
    attn = "model.layers.1.self_attn"  # lightning attention: per-head decay tables, head dim where each has it
    buffers = minimax.styles[f"{attn}#params"].buffers
    assert {n: p.dim for n, p in buffers.items()} == {"slope_rate": 0, "query_decay": 0, "key_decay": 0, "diagonal_decay": 1}
    assert minimax.local_counts[attn] == {"num_attention_heads": 2}
    kimi = infer_tp_plan(transformers.AutoModelForCausalLM.from_config(make_config("kimi_linear")), 2)
    delta = "model.layers.0.self_attn"
    assert kimi.packings[f"{delta}.forget_gate.A_log"].dim == 2  # (1, 1, heads, 1)
    assert kimi.styles[f"{delta}.forget_gate.f_b_proj"].kind == "col"
    # The gates' down projections stay plain: their gradient arrives complete through the up projections.
    assert kimi.styles.get(f"{delta}.g_a_proj") is None and kimi.styles.get(f"{delta}.forget_gate.f_a_proj") is None
    assert "g_a_proj.weight" not in kimi.styles[f"{delta}#params"].whole
    assert kimi.local_counts[f"{delta}.forget_gate"] == {"num_heads": 2, "qkv_dim": 16}


def _zoo_model(name: str, **overrides: object) -> nn.Module:
    """A transformers model of the zoo (tests/zoo.py), its config changed by ``overrides``."""
    transformers = pytest.importorskip("transformers")
    from tests.zoo import make_config

    config = make_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_key_value_heads_fewer_than_the_ranks_are_shared() -> None:
    # Multi-query attention (Gemma-2B's one key/value head; StarCoder's fused [all q; k; v]) at tp2: q is split by
    # heads, k and v are stored split and gathered whole in the forward, where each rank keeps the head its queries
    # read; its code reshapes with one key/value head and this rank's query heads per key/value head.
    plan = infer_tp_plan(_zoo_model("gemma_mqa"), 2)
    attn = "model.layers.0.self_attn"
    assert [type(plan.styles[f"{attn}.{n}"]).__name__ for n in ("q_proj", "k_proj", "v_proj")] == [
        "SplitLinear", "SharedKVHeads", "SharedKVHeads"]
    assert plan.local_counts[attn] == {"num_key_value_groups": 2, "config.num_attention_heads": 2,
                                       "config.num_key_value_heads": 1}
    fused = infer_tp_plan(_zoo_model("gpt_bigcode", multi_query=True), 2).styles["transformer.h.0.attn.c_attn"]
    assert fused.packing.sizes == (32, 8, 8) and fused.shared == (False, True, True)


@pytest.mark.parametrize(
    ("name", "overrides", "tp", "match"),
    [
        ("qwen2", {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 4}, 2,
         r"key/value heads = 3 is not divisible by tensor_parallel\(2\).*or, for key/value heads, a multiple of them"),
        ("olmo2", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 4}, 4,
         (r"2 key/value head\(s\), fewer than tensor_parallel\(4\).*its norm 'k_norm' spans all key/value heads'"
          r" features.*use a tensor_parallel degree that divides its 2 key/value heads")),
        ("falcon", {"num_attention_heads": 8, "num_kv_heads": 2}, 4,
         (r"'transformer.h.0.self_attention.query_key_value' fuses q, k and v grouped per head or per key/value group,"
          r" and its 2 key/value head\(s\) are fewer than tensor_parallel\(4\)")),
    ],
)
def test_key_value_heads_that_cannot_be_shared_are_refused(name: str, overrides: dict, tp: int, match: str) -> None:
    # A count the degree neither divides nor is a multiple of; a norm over all key/value heads' features (OLMo-2's
    # k_norm with two heads: over one head it is exact); rows grouped per key/value group (Falcon's new layout).
    with pytest.raises(ValueError, match=match):
        infer_tp_plan(_zoo_model(name, **overrides), tp)


def test_lora_on_shared_key_value_heads_follows_the_shared_split() -> None:
    # The LoRA layer takes its projection's style: base layer and lora_B gathered per shared head (parity:
    # tests/test_real_setups.py::test_lora_under_tensor_parallelism_matches_one_process).
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_zoo_model("gemma_mqa"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    styles = infer_tp_plan(model, 2).styles
    attn = "base_model.model.model.layers.0.self_attn"
    assert type(styles[f"{attn}.v_proj"]).__name__ == "SharedKVHeads"
    assert type(styles[f"{attn}.q_proj"]).__name__ == "SplitLinear"
    assert not any(k.startswith(f"{attn}.v_proj.") for k in styles), "its inner layers are split with it"


@pytest.mark.parametrize(("width", "split"), [(32, True), (4, True), (3, False)])
def test_attention_output_gate_is_split_with_the_heads(width: int, split: bool) -> None:
    # A gate per feature of every head (AFMoE's gate_proj: 32 = 4 heads x 8) or per head (LFM3's g_proj: 4) is
    # split with q; any other width is not known and is refused with the fix.
    model = _gpt()
    for block in model.layers:
        block.attn.g_proj = nn.Linear(32, width, bias=False)
    if not split:
        with pytest.raises(ValueError, match=r"Cannot decide how to split Linear 'layers.0.attn.g_proj'"):
            infer_tp_plan(model, 2)
        return
    assert infer_tp_plan(model, 2).styles["layers.0.attn.g_proj"].kind == "col"


class _EmbeddingWithParts(nn.Embedding):
    """An embedding class holding a module of its own (Inkling-2's), which torch's embedding style cannot split."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__(vocab, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(idx))


def test_embedding_split_by_vocabulary_unless_it_holds_modules() -> None:
    model = _gpt()
    assert type(infer_tp_plan(model, 2).styles["tok_emb"]).__name__ == "VocabEmbedding"
    model.tok_emb = _EmbeddingWithParts(64, 32)
    assert "tok_emb" not in infer_tp_plan(model, 2).styles


def test_codegen_qkv_is_split_by_whole_groups_or_refused() -> None:
    # CodeGen views its fused qkv_proj as 4 groups of [q; v; k] whatever the width: a degree dividing 4 hands each
    # rank whole groups (and patches the group count it views with); one that does not would cut a group apart.
    model = _zoo_model("codegen", n_head=8, n_embd=64)
    assert infer_tp_plan(model, 2).local_counts["transformer.h.0.attn"]["mp_num"] == 2
    with pytest.raises(ValueError, match=r"mp_num=4 groups of \[q; v; k\]; tensor_parallel\(8\) would cut a group"):
        infer_tp_plan(model, 8)


def test_differential_attention_splits_each_half_of_its_heads() -> None:
    # DiffLlama pairs head h with head h + heads/2: q, k and v are split per half so a rank holds whole pairs; its
    # λ vectors stay whole with their gradient summed; key/value heads per half must divide by the degree.
    model = _zoo_model("diffllama")
    plan = infer_tp_plan(model, 2)
    attn = "model.layers.0.self_attn"
    assert plan.packings[f"{attn}.q_proj.weight"].sizes == (16, 16) and plan.packings[f"{attn}.v_proj.weight"].sizes == (8, 8)
    assert type(plan.styles[f"{attn}#own"]).__name__ == "OwnShared"
    with pytest.raises(ValueError, match=r"key/value heads per half = 2 is not divisible by tensor_parallel\(4\)"):
        infer_tp_plan(model, 4)


def test_experts_called_by_the_block_gather_their_own_tokens_under_sequence_parallelism() -> None:
    # Gemma 4 calls its router and experts from the block on the flattened tokens: under sequence parallelism each
    # gathers all tokens itself (the experts before their gradient sum), the experts' output is scattered back after
    # it is summed, and the block's norms stay on token shards. Hook order is style order, so it is asserted.
    model = _zoo_model("gemma4")
    plan = infer_tp_plan(model, 2)
    assert plan.sequence_parallel and not plan.notes
    keys = [k for k in plan.styles if k.startswith("model.layers.0.router") or k.startswith("model.layers.0.experts")]
    assert keys == ["model.layers.0.router#in", "model.layers.0.experts#in", "model.layers.0.experts", "model.layers.0.experts#out"]
    assert type(plan.styles["model.layers.0.pre_feedforward_layernorm_2"]).__name__ == "ReplicatedOnShards"


def test_embedding_lookups_inside_an_mlp_are_refused() -> None:
    # Doge's CDMoE MLP looks up expert vectors (down_embed, up_embed) beside its gate/up/down projections: each rank
    # would sum a whole gradient as if it were its part. It crashed in the router's top-k at the first step.
    model = _zoo_model("doge", is_moe=True, num_experts=16, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.(down|up)_embed' holds parameters inside the tensor") as e:
        infer_tp_plan(model, 2)
    # The fix named is one that exists: a splitting style for a Linear was advised, which an embedding cannot take.
    assert "An embedding takes no splitting style" in str(e.value) and "'colwise'" not in str(e.value)


def test_experts_stacked_in_2d_weights_are_split_per_expert() -> None:
    # DBRX stores each expert's FFN rows stacked in (experts x FFN, hidden) weights that its forward views per expert
    # with ffn_hidden_size: each rank holds its slice of every expert's rows (a packing of one piece per expert) and
    # views them with its own width.
    plan = infer_tp_plan(_zoo_model("dbrx"), 2)
    experts = "transformer.blocks.0.ffn.experts"
    style = plan.styles[experts]
    assert type(style).__name__ == "SplitExperts" and sorted(style.params) == ["mlp.v1", "mlp.w1", "mlp.w2"]
    assert plan.packings[f"{experts}.mlp.w1"].sizes == (32,) * 4 and plan.local_counts[experts] == {"ffn_hidden_size": 16}
    assert plan.sequence_parallel


def test_blocks_the_plan_leaves_whole_are_named() -> None:
    # A lecture GPT's attention holds a ModuleList of per-head Linears: the plan kept every linear of its blocks
    # whole and said so only in an INFO log, so tp2 ran with whole blocks on every rank while the user believed
    # them split.
    from lightning_llmpar.parallelize import _warn_if_blocks_stay_whole

    class PerHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(16, 4, bias=False) for _ in range(4))
            self.proj = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.proj(torch.cat([h(x) for h in self.heads], dim=-1))

    model = nn.Module()
    model.emb, model.blocks, model.head = nn.Embedding(8, 16), nn.Sequential(PerHeads(), PerHeads()), nn.Linear(16, 8)
    with pytest.warns(UserWarning, match=r"tensor_parallel=2 splits nothing inside the blocks of 'blocks'.*"
                                         r"'blocks.0.heads.0'.*tp_plan"):
        _warn_if_blocks_stay_whole(model, infer_tp_plan(model, 2).styles, 2)
    gpt = _gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_if_blocks_stay_whole(gpt, infer_tp_plan(gpt, 2).styles, 2)


def test_a_second_stack_the_plan_leaves_whole_is_named() -> None:
    # BART's plan splits its decoder's blocks (the stack found) and kept its encoder whole on every rank, unsaid.
    transformers = pytest.importorskip("transformers")
    from lightning_llmpar.parallelize import _warn_if_blocks_stay_whole

    config = transformers.BartConfig(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
                                     max_position_embeddings=32)
    model = transformers.BartForConditionalGeneration(config)
    with pytest.warns(UserWarning, match=r"splits the blocks of 'model.decoder.layers'; those of 'model.encoder.layers'"
                                         r" stay whole"):
        _warn_if_blocks_stay_whole(model, infer_tp_plan(model, 2).styles, 2)
    # (A model with one stack stays silent: the GPT of the test above.)


def test_a_projection_wrapped_by_a_hand_written_adapter_is_refused_with_the_fix() -> None:
    # A LoRA written by hand (the projection as `base`, low-rank matrices beside it) under transformers' plan names
    # q_proj for a split: it failed with AttributeError: 'LoRALinear' object has no attribute 'weight'.
    class LoRALinear(nn.Module):
        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base = base
            self.lora_a = nn.Parameter(torch.zeros(4, base.in_features))
            self.lora_b = nn.Parameter(torch.zeros(base.out_features, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()

    model = _zoo_model("llama")
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj' is a LoRALinear") as e:
        infer_tp_plan(model, 2)
    assert "'model.layers.0.self_attn.q_proj.base'" in str(e.value) and "peft" in str(e.value)
