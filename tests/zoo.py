"""A model zoo of third-party architectures, built offline from tiny configs, wrapped as a user would.

Each entry is a transformers causal LM (random weights, every dropout off) inside a LightningModule that
knows nothing about parallelism: dict batches, ``self.model(input_ids=..., labels=...).loss``. Many cases
run inside one launch of the ranks (process start-up dominates tiny models), and the one-process
reference of each model is computed once.
"""

from __future__ import annotations

import copy
import re
from contextlib import nullcontext
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, default_collate

from lightning_llmpar.data import ordered_loader
from tests.custom_models import ShiftedLM
from tests.workloads import kernels

VOCAB, SEQ, SAMPLES = 64, 16, 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32)
_NO_SDPA = {"gemma2", "gemma2_full", "bloom", "gpt_oss", "mamba", "mpt", "openai_gpt", "gpt_neox_japanese"}
# Gemma 4 amplifies fp32 reordering at lr 0.5: one process against two data-parallel ranks (alike at ZeRO 0, 1
# and 3) drifts ~30x a step from 2e-7 while the first step's gradients agree within 1.2e-7. Its cases train at a
# rate where six steps stay comparable.
# OLMo-2 with one key/value head at tp2: first-step gradients within 1.9e-7, losses exact for five steps at lr 0.5 and
# 1.4e-4 off at the sixth (alike at every step at lr 0.05), the same amplification.
# Gemma-2 at cp2 (SDPA per part against one process's eager attention): at lr 0.5 the ninth step is 1.7e-5 off.
_LR = {"gemma4": 0.005, "gemma4_ple": 0.005, "olmo2_mqa": 0.05, "gemma2_full": 0.05}

# name -> (config class, overrides); "_tied"/"_untied" suffixes flip tie_word_embeddings.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 8}),
    # Gemma-2 as context parallelism takes it: no layer slides (sliding_window stays set: the model reads it), no cap.
    "gemma2_full": ("Gemma2Config", {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 8,
                                     "layer_types": ["full_attention"] * 4, "attn_logit_softcapping": None}),
    "phi3": ("Phi3Config", {"num_key_value_heads": 4, "pad_token_id": 0}),
    "phi3_gqa": ("Phi3Config", {"pad_token_id": 0}),
    # An odd vocabulary, as GPT-2's 50257 is: split unevenly over the ranks (the data uses the first 64 tokens).
    "gpt2": ("GPT2Config", {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 32, "n_inner": 64, "vocab_size": 65}),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "opt": ("OPTConfig", {"ffn_dim": 64, "word_embed_proj_dim": 32, "pad_token_id": 1}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # The router's load-balancing loss added to the loss (in place, by transformers), as MoE models train.
    "mixtral_aux": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True}),
    "olmo2": ("Olmo2Config", {"pad_token_id": 0}),
    "starcoder2": ("Starcoder2Config", {"sliding_window": None}),
    "falcon": ("FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 2, "ffn_hidden_size": 64}),
    "bloom": ("BloomConfig", {"n_layer": 4, "n_head": 4}),
    "mpt": ("MptConfig", {"d_model": 32, "n_heads": 4, "n_layers": 4, "max_seq_len": 32}),  # fused [q; k; v], ALiBi
    "openai_gpt": ("OpenAIGPTConfig", {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 32}),  # blocks return lists
    "afmoe": ("AfmoeConfig", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "num_shared_experts": 1, "sliding_window": 8,
                              "layer_types": ["sliding_attention", "full_attention"] * 2}),  # output gate per feature
    "lfm3": ("Lfm3Config", {"head_dim": 8, "sliding_window": 8, "pad_token_id": 0,  # output gate per head
                            "layer_types": ["conv", "full_attention", "sliding_attention", "conv"]}),
    "gpt_bigcode": ("GPTBigCodeConfig", {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 32, "n_inner": 64,
                                         "multi_query": False}),  # StarCoder's layout with one key/value per head
    "granite": ("GraniteConfig", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 32}),
    "glm4_moe": ("Glm4MoeConfig", {"head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 8}),
    "cohere": ("CohereConfig", {}),
    "phi": ("PhiConfig", {"num_key_value_heads": 4}),
    "smollm3": ("SmolLM3Config", {"pad_token_id": 0}),
    "persimmon": ("PersimmonConfig", {}),
    "nemotron": ("NemotronConfig", {"head_dim": 8}),
    "apertus": ("ApertusConfig", {}),
    "gpt_oss": ("GptOssConfig", {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}),
    "llama4": ("Llama4TextConfig", {"head_dim": 8, "num_local_experts": 4, "intermediate_size_mlp": 64}),
    "deepseek_v3": ("DeepseekV3Config", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                                         "v_head_dim": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}),
    # Latent attention without a query latent (q_proj), split by heads as DeepSeek-V3's.
    "deepseek_v2": ("DeepseekV2Config", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                                         "qk_nope_head_dim": 4, "v_head_dim": 8, "num_key_value_heads": 4,
                                         "first_k_dense_replace": 1}),
    # State-space models: Mamba(-1) mixers alone and between attention layers of another class (Jamba), Mamba-2
    # mixers in hybrids (Bamba's blocks return tuples; Nemotron-H's forward reads each block's type; Falcon-H1
    # scales in_proj's pieces with a buffer and norms per group; Granite-4 has an ungated-name shared MLP and, as
    # released, one head group shared by every rank's heads).
    "mamba": ("MambaConfig", {"state_size": 4, "time_step_rank": 4, "pad_token_id": 0}),
    # Linear-attention hybrids with their own kinds of mixer: MiniMax's lightning attention (per-head decay tables
    # as buffers saved with the weights), Kimi Linear's delta attention (low-rank decay and output gates) beside
    # latent attention.
    "minimax": ("MiniMaxConfig", {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "kimi_linear": ("KimiLinearConfig", {"layer_types": ["linear_attention", "full_attention", "linear_attention",
                                                         "full_attention"], "linear_num_heads": 4, "linear_head_dim": 8,
                                         "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4,
                                         "qk_nope_head_dim": 4, "v_head_dim": 8, "n_group": 1, "topk_group": 1,
                                         "pad_token_id": 0}),
    "jamba": ("JambaConfig", {"num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 4, "mamba_dt_rank": 4,
                              "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                              "expert_layer_offset": 1, "pad_token_id": 0}),
    "bamba": ("BambaConfig", {"attn_layer_indices": [1, 3], "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 2,
                              "mamba_d_state": 4, "mamba_chunk_size": 8, "pad_token_id": 0}),
    "nemotron_h": ("NemotronHConfig", {"layers_block_type": ["mamba", "attention", "mamba", "mlp"], "ssm_state_size": 4,
                                       "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2, "head_dim": 8,
                                       "chunk_size": 8, "pad_token_id": 0}),
    "falcon_h1": ("FalconH1Config", {"mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 2,
                                     "mamba_d_state": 4, "mamba_chunk_size": 8, "head_dim": 8, "pad_token_id": 0}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", {"layer_types": ["mamba", "attention", "mamba", "attention"],
                                                    "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 1,
                                                    "mamba_d_state": 4, "mamba_chunk_size": 8, "num_local_experts": 4,
                                                    "num_experts_per_tok": 2, "shared_intermediate_size": 64,
                                                    "pad_token_id": 0}),
    # Gated delta-rule linear attention between attention layers: rows grouped per key head (Qwen3-Next),
    # [all q; all k; all v] (Qwen3.5, with MoE layers and shared experts) or separate q/k/v/a/b/g projections
    # (OLMo-Hybrid).
    "qwen3_next": ("Qwen3NextConfig", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                       "shared_expert_intermediate_size": 32, "linear_num_value_heads": 4,
                                       "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                       "full_attention_interval": 2}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {"head_dim": 8, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                                             "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                             "full_attention_interval": 2, "num_experts": 4, "num_experts_per_tok": 2,
                                             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                                             "pad_token_id": 0}),
    # Gemma 4 as its large models are (26B-A4B): experts called by the block beside a dense MLP, full-attention
    # layers with their own head size and fewer key/value heads (read per layer from the config), keys as values.
    "gemma4": ("Gemma4TextConfig", {"head_dim": 8, "global_head_dim": 16, "sliding_window": 8,
                                    "layer_types": ["sliding_attention", "full_attention"] * 2,
                                    "hidden_size_per_layer_input": 0, "attention_k_eq_v": True,
                                    "num_key_value_heads": 4, "num_global_key_value_heads": 2, "enable_moe_block": True,
                                    "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
                                    "pad_token_id": 0}),
    # As its small models are (E2B, E4B): per-layer inputs computed before the stack, gated into every block by
    # Linears of no attention or MLP role, and the last layers reusing earlier layers' keys and values.
    "gemma4_ple": ("Gemma4TextConfig", {"head_dim": 8, "global_head_dim": 16, "sliding_window": 8,
                                        "layer_types": ["sliding_attention", "full_attention"] * 2,
                                        "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
                                        "num_kv_shared_layers": 2, "pad_token_id": 0}),
    # Gemma 3n's per-layer inputs also enter through a scale initialized to zero; its blocks carry four streams.
    "gemma3n": ("Gemma3nTextConfig", {"head_dim": 8, "sliding_window": 8,
                                      "layer_types": ["sliding_attention", "full_attention"] * 2,
                                      "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
                                      "num_kv_shared_layers": 0, "laurel_rank": 4,
                                      "activation_sparsity_pattern": [0.0] * 4, "pad_token_id": 0}),
    "dbrx": ("DbrxConfig", {"d_model": 32, "n_heads": 4, "n_layers": 4, "max_seq_len": 32, "pad_token_id": 0,
                            "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
                            "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}}),
    # CodeGen's fused qkv_proj holds 4 groups of [q; v; k] (a constant of its forward): each rank gets whole groups.
    "codegen": ("CodeGenConfig", {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 32, "n_ctx": 32,
                                  "rotary_dim": 4, "pad_token_id": 0}),
    # Differential attention pairs head h with head h + heads/2, and all heads share its λ vectors.
    "diffllama": ("DiffLlamaConfig", {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4, "pad_token_id": 0}),
    # Doge's dynamic mask: one value per key/value head from all heads' values (dt_proj) and a parameter of its own
    # per key/value head (A). Its window is longer than the sequence: top-k keys over exp(A * softplus(dt)), with A
    # zero at initialization, picks among values equal to the last bit, so any reordered sum flips the choice.
    "doge": ("DogeConfig", {"attention_bias": True, "pad_token_id": 0}),
    # GPT-NeoX-Japanese: per-head fused [q_h; k_h; v_h], and the last layer's attention returns a bias of its own
    # that the block adds after the output projection.
    "gpt_neox_japanese": ("GPTNeoXJapaneseConfig", {}),
    # Zamba2's hybrid layers each hold a copy of one shared attention block, tied to the same parameters.
    "zamba2": ("Zamba2Config", {"head_dim": 8, "layers_block_type": ["mamba", "hybrid"] * 2, "pad_token_id": 0}),
    # Fewer key/value heads than tensor-parallel ranks: each shared by several ranks (multi-query attention as Gemma-2B
    # has it, with its tied embeddings; Qwen3's per-head k norm on the shared head; StarCoder's [all q; k; v] with one
    # key/value head, and Falcon-7B's).
    "gemma_mqa": ("GemmaConfig", {"num_key_value_heads": 1, "head_dim": 8}),
    "qwen3_mqa": ("Qwen3Config", {"head_dim": 8, "num_key_value_heads": 1}),
    "qwen2_gqa": ("Qwen2Config", {"num_attention_heads": 8, "head_dim": 4}),  # its 2 key/value heads at tp4
    "gpt_bigcode_mqa": ("GPTBigCodeConfig", {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 32,
                                             "n_inner": 64, "multi_query": True}),
    "falcon_mqa": ("FalconConfig", {"new_decoder_architecture": False, "multi_query": True, "ffn_hidden_size": 64}),
    "falcon_kv1": ("FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 1, "ffn_hidden_size": 64}),  # one group
    "recurrent_gemma": ("RecurrentGemmaConfig", {"num_key_value_heads": 1, "lru_width": 32, "attention_window_size": 8,
                                                 "conv1d_width": 4, "block_types": ["recurrent", "attention"],
                                                 "pad_token_id": 0}),
    "olmo2_mqa": ("Olmo2Config", {"pad_token_id": 0, "num_key_value_heads": 1}),  # its k norm spans the one head
    "ctrl": ("CTRLConfig", {"n_embd": 32, "n_layer": 4, "n_head": 4, "dff": 64, "n_positions": 32, "pad_token_id": 0}),
    "lfm2": ("Lfm2Config", {"layer_types": ["conv", "full_attention"] * 2, "pad_token_id": 0}),  # gated short convolutions
    "olmo_hybrid": ("OlmoHybridConfig", {"layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_key_heads": 2,
                                         "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                         "pad_token_id": 0}),
}


def make_config(name: str, dropout: float = 0.0) -> Any:
    import transformers

    base = re.sub(r"_(tied|untied)$", "", name)
    cls_name, overrides = FAMILIES[base]
    cls = getattr(transformers, cls_name)
    kwargs = {**_COMMON, **overrides}
    if name.endswith("_tied") or name.endswith("_untied"):
        kwargs["tie_word_embeddings"] = name.endswith("_tied")
    config = cls(**kwargs)
    for key, value in list(vars(config).items()):  # every dropout set, before the model copies the rates
        if isinstance(value, float) and (re.search(r"(dropout|pdrop|dropout_prob)$", key) or key == "layerdrop"):
            setattr(config, key, 0.0 if key == "layerdrop" else dropout)
    config._attn_implementation = "eager" if base in _NO_SDPA else "sdpa"
    config.use_cache = False
    return config


LITGPT = {
    "litgpt_llama": "Llama-3.2-1B", "litgpt_pythia": "pythia-14m", "litgpt_gemma2": "gemma-2-2b", "litgpt_phi2": "phi-2",
    "litgpt_qwen3": "Qwen3-0.6B", "litgpt_mixtral": "Mixtral-8x7B-v0.1", "litgpt_falcon": "falcon-7b",
    "litgpt_gemma3": "Gemma-3-1b-it", "litgpt_olmo2": "OLMo-2-1124-7B",
}


class LitGPTModule(ShiftedLM):
    """LitGPT's GPT from a small config, as a Lightning user wraps it (logits, their own shifted loss)."""

    def __init__(self, name: str, lr: float = 0.5, sgd: bool = True, **_: Any) -> None:
        super().__init__(lr, sgd)
        from litgpt import Config
        from litgpt.model import GPT

        family = LITGPT[name]
        extra = {"n_expert": 4, "n_expert_per_token": 2, "moe_intermediate_size": 64} if "Mixtral" in family else {}
        groups = 1 if family == "falcon-7b" else 2  # Falcon-7B's multi-query attention: one key/value head
        config = Config.from_name(family, n_layer=4, n_embd=64, n_head=4, n_query_groups=groups, head_size=16,
                                  intermediate_size=128, vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=SEQ, **extra)
        self.model = GPT(config)


class HFCausalLM(LightningModule):
    """How a user fine-tunes a transformers causal LM with Lightning, for one device."""

    def __init__(self, name: str, lr: float = 0.5, sgd: bool = True, frozen: str | None = None, dropout: float = 0.0,
                 manual_clip: float | None = None) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.lr, self.sgd = _LR.get(re.sub(r"_(tied|untied)$", "", name), lr), sgd
        # manual_clip: manual optimization (zero_grad, manual_backward, clip_gradients by norm, step in the step).
        self.manual_clip = manual_clip
        self.automatic_optimization = manual_clip is None
        self.model = AutoModelForCausalLM.from_config(make_config(name, dropout))
        if frozen == "head_only":  # fine-tune the LM head only: the first pipeline stage has no gradient at all
            for pname, p in self.model.named_parameters():
                p.requires_grad_(pname.startswith("lm_head"))
        elif frozen == "attention":  # frozen attention projections still pass their input gradient back
            for pname, p in self.model.named_parameters():
                p.requires_grad_(".self_attn." not in pname)
        elif frozen in ("lora", "lora_all", "dora"):
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(7)
            # "lora_all": every Linear of the blocks (peft's "all-linear"), lora_B drawn nonzero so that lora_A's
            # gradient is tested from the first step.
            targets = ["q_proj", "v_proj"] if frozen == "lora" else "all-linear"
            self.model = get_peft_model(self.model, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                               init_lora_weights="gaussian", lora_dropout=dropout,
                                                               use_dora=frozen == "dora"))
            for pname, p in self.model.named_parameters():
                if frozen == "lora_all" and "lora_B" in pname:
                    torch.nn.init.normal_(p, std=0.05)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.manual_clip is not None:
            optimizer = self.optimizers()
            optimizer.zero_grad()
        loss = self.loss(batch)
        self.log("train_loss", loss)
        if self.manual_clip is not None:
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=self.manual_clip, gradient_clip_algorithm="norm")
            optimizer.step()
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # The mean over the batch's valid labels; over the data-parallel ranks weighed by theirs under "tokens".
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = list(self.parameters())  # frozen ones get no gradient and no update
        if self.sgd:  # SGD: a wrong gradient scale shows in the loss (Adam would hide it)
            return torch.optim.SGD(params, lr=self.lr)
        return torch.optim.AdamW(params, lr=1e-2)


class PadTokenLoss(HFCausalLM):
    """transformers' Llama with a loss of one's own that ignores the pad token (0, what its labels are padded
    with), not -100."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__("llama", **kwargs)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=0)


class PadTokenKwarg(HFCausalLM):
    """transformers' Llama told the pad token (0, what its labels are padded with) as its loss's ``ignore_index``
    in the forward call, which pads the shifted labels with it."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__("llama", **kwargs)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch, ignore_index=0).loss


class PadTokenValidation(HFCausalLM):
    """transformers' Llama trained on its own loss (-100 ignored; labels padded with the pad token, 0, which then
    count), validated on a loss ignoring the pad token."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__("llama", **kwargs)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=0)
        self.log("val_loss", loss, sync_dist=True)


class TwoLabelSets(HFCausalLM):
    """transformers' Llama with a second cross-entropy over as many targets (another label set, ignoring -1), first."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__("llama", **kwargs)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        second = torch.where(labels == -100, -1, (labels + 1) % VOCAB)
        return (torch.nn.functional.cross_entropy(logits.flatten(0, 1), second.flatten(), ignore_index=-1)
                + torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


class HiddenStatesLoss(HFCausalLM):
    """transformers' Llama with terms on its second layer's output and its final state (``output_hidden_states=True``),
    as regularizers and layer-wise distillation read them."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__("llama", **kwargs)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.model(**batch, output_hidden_states=True)
        return out.loss + 0.1 * out.hidden_states[2].pow(2).mean() + 0.1 * out.hidden_states[-1].pow(2).mean()


class ReentrantCheckpointing(HFCausalLM):
    """transformers' Llama with its own gradient checkpointing, asked to be reentrant."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__("llama", **kwargs)
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


HF_VARIANTS = {"pad_token_loss": PadTokenLoss, "pad_token_kwarg": PadTokenKwarg, "pad_token_validation": PadTokenValidation,
               "two_label_sets": TwoLabelSets, "hidden_states_loss": HiddenStatesLoss,
               "reentrant_checkpointing": ReentrantCheckpointing}


class _Tokens(Dataset):
    """Random token windows; ``padded``: right-padded to SEQ from random lengths (labels -100, attention mask;
    ``"positions"``: also position_ids, the pads' counted from 0 again, as some collators write them; ``"ignored"``:
    some samples' labels all -100; ``"pad_token"``: labels padded with 0, the pad token; ``"item_count"``: batches
    also carry transformers' ``num_items_in_batch``, their valid targets); ``pairs``: (inputs, targets) from windows of SEQ + 1 tokens, as pretraining data comes, instead of dicts."""

    def __init__(self, n: int, seed: int = 1234, padded: bool | str = False, pairs: bool = False) -> None:
        self.pad_positions = padded == "positions"
        self.pad_label = padded == "pad_token"  # labels padded with the pad token (0), for a loss ignoring it
        # "ignored": samples whose labels are all ignored (a masked prompt), so that in the first global batch a
        # data-parallel rank (samples 0, 2, 4, 6) and a pipeline's first microbatches hold no valid target.
        self.ignored = {0, 1, 2, 3, 4, 6} if padded == "ignored" else set()
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
        self.lengths = torch.randint(3, SEQ + 1, (n,), generator=g) if padded else None
        self.next = torch.randint(2, VOCAB, (n, 1), generator=g) if pairs else None  # each window's last target

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Any:
        if self.next is not None:
            return self.ids[i], torch.cat([self.ids[i][1:], self.next[i]])
        if self.lengths is None:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}
        keep = torch.arange(SEQ) < self.lengths[i]
        labels = torch.where(keep & (i not in self.ignored), self.ids[i], 0 if self.pad_label else -100)
        row = {"input_ids": torch.where(keep, self.ids[i], 0), "labels": labels, "attention_mask": keep.long()}
        if self.pad_positions:
            row["position_ids"] = torch.where(keep, torch.arange(SEQ), torch.arange(SEQ) - self.lengths[i])
        return row


class DictTokenData(LightningDataModule):
    """Dict batches in a fixed order: data-parallel rank r takes samples r, r+dp, ... (no shuffling)."""

    def __init__(self, batch_size: int, n: int = SAMPLES, padded: bool | str = False, pairs: bool = False) -> None:
        super().__init__()
        self.data, self.batch_size = _Tokens(n, padded=padded, pairs=pairs), batch_size
        self.item_count = padded == "item_count"

    def train_dataloader(self) -> DataLoader:
        loader = ordered_loader(self.data, self.batch_size, self.trainer.strategy, drop_last=True)
        if self.item_count:
            loader.collate_fn = _with_item_count
        return loader


def _with_item_count(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A collate function that counts the batch's valid targets, as transformers' Trainer does for its loss."""
    batch = default_collate(rows)
    batch["num_items_in_batch"] = (batch["labels"][:, 1:] != -100).sum()
    return batch


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class Record(Callback):
    """Per-step loss and the first step's full gradients, named and laid out as one process has them."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: dict[str, torch.Tensor] = {}
        self.metrics: list[dict[str, float]] = []  # what was logged, per step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int) -> None:
        # A context-parallel rank's loss is the mean over its part of the sequences; weighted by its share of the
        # targets, the mean over ranks is the loss of the whole batch.
        cp = getattr(trainer.strategy, "context_parallel", None)
        self.losses.append(float(outputs["loss"]) * (cp.loss_weight if cp is not None else 1.0))
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.grads:
            return
        from lightning_llmpar.modeling.packing import to_canonical

        strategy = trainer.strategy
        packings = getattr(strategy, "packings", {})
        aliases = getattr(strategy, "tied_aliases", {})
        for name, p in pl_module.named_parameters():
            if p.grad is None:
                continue
            grad = full(p.grad).cpu()
            if name in packings:
                grad = to_canonical(grad, packings[name])
            self.grads[aliases.get(name, name)] = grad


def assert_exact(ref: dict[str, Any], outs: list[dict[str, Any]], sharded: bool = True) -> None:
    """A layout's per-rank results reproduce the one-process reference: losses (mean over ranks) and every
    parameter's gradient, fp32 within 1e-5 and within 0.1% of its norm (and of each row's)."""
    assert "error" not in ref, ref.get("error")
    for out in outs:
        assert "error" not in out, out["error"]
        # torch's warnings of our mesh or outputs: slicing a flattened mesh axis (deprecated); under tensor
        # parallelism, a view leaving an FSDP unit (the stack's gathered output; elsewhere a model's own views warn)
        noted = [w for w in out.get("torch_distributed_warnings", ())
                 if "flattened dim" in w or ("view tensor" in w and out.get("tensor_parallel", 1) > 1)]
        assert not noted, noted
    steps = len(ref["losses"])
    assert steps >= 6 and all(len(o["losses"]) == steps for o in outs)
    for i in range(steps):
        loss = sum(o["losses"][i] for o in outs) / len(outs)
        assert abs(loss - ref["losses"][i]) < 1e-5, f"step {i}: {loss} vs {ref['losses'][i]}"
    grads: dict[str, torch.Tensor] = {}
    for out in outs:
        grads.update(out["grads"])
    assert sorted(grads) == sorted(ref["grads"]), "every parameter gets its gradient on some rank"
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=f"grad {name}")
        # Relative to the parameter's own gradient too: one whose gradient is small (a norm's weight at
        # initialization) could otherwise be off by a factor within atol.
        error, size = (grads[name] - grad).norm().item(), grad.norm().item()
        assert error <= 1e-3 * size + 1e-9, f"grad {name}: off by {error:.3g}, its norm is {size:.3g}"
        if grad.dim() >= 2:
            # And row by row: a packed projection's small piece (Mamba-2's B and C rows of in_proj) could otherwise
            # be wrong within 0.1% of the whole weight's norm. fp32 reordering leaves each row within ~1e-6.
            errors, sizes = (grads[name] - grad).flatten(1).norm(dim=1), grad.flatten(1).norm(dim=1)
            bad = int(torch.argmax(errors - 1e-3 * sizes))
            assert errors[bad] <= 1e-3 * sizes[bad] + 1e-10, (
                f"grad {name} row {bad}: off by {errors[bad]:.3g}, its norm is {sizes[bad]:.3g}"
            )
    # No layout may run silently replicated: each rank holds a fraction of the parameters (ZeRO-1 shards only
    # optimizer state).
    if sharded:
        assert all(o["held"] < 0.8 for o in outs), [o["held"] for o in outs]


def fit_case(
    name: str,
    strategy_kwargs: dict[str, Any] | None,
    batch_size: int,
    steps: int = 6,
    *,
    meta: bool = False,
    pretrained: str | None = None,
    litgpt_pretrained: str | None = None,
    save_hf: str | None = None,
    save_to: str | None = None,
    ckpt_path: str | None = None,
    sgd: bool = True,
    frozen: str | None = None,
    dropout: float = 0.0,
    padded: bool | str = False,
    clip: float | None = None,
    accumulate: int = 1,
    precision: Any = None,
    samples: int = SAMPLES,
    checkpointing: str | None = None,
    manual: bool = False,
    validate: bool = False,
    guard: bool = False,
) -> dict[str, Any]:
    """Train zoo model ``name`` for ``steps``; ``strategy_kwargs=None`` is the one-process reference.

    ``pretrained``: a transformers directory, loaded by ``from_pretrained`` in the reference and through the
    strategy's ``hf_checkpoint`` otherwise (built on the meta device with ``meta``); ``save_hf``: export the
    trained model there; ``save_to`` / ``ckpt_path``: write / resume a Lightning checkpoint; ``manual`` (with
    ``clip``): Hugging Face models optimize by hand in their step, clipping the gradient norm to ``clip``.
    """
    import os

    from lightning_llmpar import LLMParallelStrategy, save_hf_checkpoint

    seed_everything(0, verbose=False)
    record = Record()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    kwargs = dict(strategy_kwargs or {})
    if kwargs.get("compile"):
        # Compiled code and the frame counter are per process: start each case afresh, so an earlier case's
        # compilations neither count for it nor use up its recompilations.
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    if pretrained is not None and strategy_kwargs is not None:
        kwargs["hf_checkpoint"] = pretrained
    if litgpt_pretrained is not None and strategy_kwargs is not None:
        kwargs["litgpt_checkpoint"] = litgpt_pretrained
    plugins, precision_flag = _precision(precision)
    trainer = Trainer(
        accelerator="cpu",
        devices=1 if strategy_kwargs is None else world,
        strategy="auto" if strategy_kwargs is None else LLMParallelStrategy(**kwargs),
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=[record, *_checkpointing(checkpointing), *_guard(guard)],
        gradient_clip_val=None if manual else clip, accumulate_grad_batches=accumulate, plugins=plugins, precision=precision_flag,
    )
    # '64-true' makes parameters in float64 inside init_module (other random draws than fp32's and a cast): the
    # reference makes them there too.
    inside = strategy_kwargs is not None or precision == "64-true"
    with trainer.init_module(empty_init=meta) if inside else nullcontext():
        from tests.custom_models import CUSTOM

        cls = LitGPTModule if name in LITGPT else HF_VARIANTS.get(name) or CUSTOM.get(name, HFCausalLM)
        extra = {"manual_clip": clip} if manual else {}  # the step clips by itself (Lightning refuses gradient_clip_val)
        module = cls(name, sgd=sgd, frozen=frozen, dropout=dropout, **extra)
    total = sum(p.numel() for p in module.parameters())
    if pretrained is not None and strategy_kwargs is None:
        from transformers import AutoModelForCausalLM

        module.model = AutoModelForCausalLM.from_pretrained(pretrained, config=module.model.config)
    if litgpt_pretrained is not None and strategy_kwargs is None:
        module.model.load_state_dict(torch.load(f"{litgpt_pretrained}/lit_model.pth", weights_only=True))
    data = DictTokenData(batch_size, n=samples, padded=padded, pairs=getattr(module, "batch_pairs", False))
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    val_loss = None
    if validate:  # the logged validation loss after training (rank 0's data: compare layouts without data parallelism)
        trainer.validate(module, ordered_loader(data.data, batch_size, trainer.strategy), verbose=False)
        val_loss = float(trainer.callback_metrics["val_loss"])
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    if save_hf is not None:
        if strategy_kwargs is None:  # peft's own merge of the adapters: what an export folds them into
            model = module.model
            merged = copy.deepcopy(model).merge_and_unload() if hasattr(model, "merge_and_unload") else model
            merged.save_pretrained(save_hf)
        else:
            save_hf_checkpoint(trainer, save_hf)
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())
    engine = getattr(trainer.strategy, "engine", None)
    dtype = next((engine.module if engine is not None else module).parameters()).dtype
    packings = getattr(trainer.strategy, "packings", {})
    aliases = getattr(trainer.strategy, "tied_aliases", {})
    params = {}
    if engine is None:
        from lightning_llmpar.modeling.packing import to_canonical

        for pname, p in module.named_parameters():
            value = full(p).cpu()
            params[aliases.get(pname, pname)] = to_canonical(value, packings[pname]) if pname in packings else value
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import FSDPModule

    from lightning_llmpar.data_parallel.replicate import DDP

    wrapper = "ddp" if isinstance(module, DDP) else "fsdp2" if any(isinstance(m, FSDPModule) for m in module.modules()) else None

    # Matmuls and attention that inductor's generated code calls: none when compiled frames ran the blocks eagerly.
    compiled_extern_calls = counters["inductor"]["extern_calls"]
    return {"compiled_frames": counters["frames"]["ok"], "compiled_extern_calls": compiled_extern_calls,
            "losses": record.losses, "grads": record.grads, "held": held / total, "param_dtype": str(dtype),
            "plugin": type(trainer.precision_plugin).__name__, "params": params, "metrics": record.metrics,
            "kernels": kernels(trainer), "data_parallel": wrapper, "val_loss": val_loss,
            "skipped_steps": [step for c in trainer.callbacks for step in getattr(c, "skipped_steps", [])]}


def _guard(on: bool) -> list[Callback]:
    from lightning_llmpar import StepGuard

    return [StepGuard()] if on else []


def _checkpointing(mode: str | None) -> list[Callback]:
    """Activation checkpointing of every block (``mode``: 'full' or 'selective'), as a user adds the callback."""
    if mode is None:
        return []
    from lightning_llmpar import ActivationCheckpointing

    return [ActivationCheckpointing(mode=mode)]


def _precision(spec: Any) -> tuple[list[Any] | None, Any]:
    """A Lightning precision string, 'lightning-16-mixed' (Lightning's own fp16 plugin with a CPU scaler, which the
    string would turn into bf16 on CPU), or (our plugin class name, kwargs)."""
    if spec is None:
        return None, "32-true"
    if spec == "lightning-16-mixed":
        from lightning.pytorch.plugins.precision import MixedPrecision

        return [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**16))], None
    if isinstance(spec, str):
        return None, spec
    from lightning_llmpar import precision as ours

    return [getattr(ours, spec[0])(**spec[1])], None


def logits_of(directory: str) -> torch.Tensor:
    """Logits of a saved transformers directory on a fixed input, in one process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = (torch.arange(SEQ).reshape(1, SEQ) * 7) % (VOCAB - 2) + 2
    with torch.no_grad():
        return model(input_ids=ids).logits


def save_litgpt(name: str, directory: str, seed: int = 42) -> None:
    """A small LitGPT checkpoint of zoo model ``name``: lit_model.pth + model_config.yaml, as LitGPT writes them."""
    import dataclasses
    from pathlib import Path

    import yaml

    torch.manual_seed(seed)
    model = LitGPTModule(name).model
    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), f"{directory}/lit_model.pth")
    Path(f"{directory}/model_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(model.config)))


def save_pretrained(name: str, directory: str, seed: int = 42) -> None:
    """A small "pretrained" checkpoint of zoo model ``name``, written as users receive them."""
    torch.manual_seed(seed)
    HFCausalLM(name).model.save_pretrained(directory)


def fit_cases(cases: list[tuple]) -> dict[tuple[str, str], Any]:
    """Run several (model, strategy kwargs, per-rank batch[, fit_case options]) cases in this launch; errors are
    reported per case."""
    import os
    import traceback
    import warnings

    env = dict(os.environ)  # Lightning's cluster environment removes WORLD_SIZE at teardown
    results: dict[tuple[str, str], Any] = {}
    for name, kwargs, batch_size, *extra in cases:
        os.environ.update(env)
        options = dict(extra[0]) if extra else {}
        key = (name, options.pop("tag", repr(kwargs)))
        try:
            with warnings.catch_warnings(record=True) as caught:  # the strategy's own, for the tests to read
                warnings.simplefilter("always")
                results[key] = fit_case(name, kwargs, batch_size, **options)
            results[key]["warnings"] = [str(w.message) for w in caught if "LLMParallelStrategy" in str(w.message)]
            results[key]["torch_distributed_warnings"] = sorted({
                str(w.message) for w in caught if os.path.join("torch", "distributed") in w.filename})
            results[key]["tensor_parallel"] = (kwargs or {}).get("tensor_parallel", 1)
        except Exception:  # noqa: BLE001 - one failing model must not hide the others' results
            results[key] = {"error": traceback.format_exc()}
    return results
