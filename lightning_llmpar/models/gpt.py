"""A small Llama-style decoder: RoPE, RMSNorm, SwiGLU and grouped-query attention; optionally mixture-of-experts
MLPs (top-k routing over SwiGLU experts, as Mixtral).

Written as for one device: nothing in it knows about parallelism. Attention reshapes with its own
head-count attributes, which tensor parallelism rescales to the per-rank counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmpar.modeling.hidden_states import EarlierStageState
from lightning_llmpar.training.documents import (
    document_causal_mask,
    document_ids_from_positions,
    is_packed,
    positions_from_documents,
)

__all__ = ["GPTConfig", "GPT", "MoE", "Experts"]


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 128
    mlp_hidden: int | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    n_expert: int = 0  # > 0: every block's MLP is a mixture of this many experts
    n_expert_per_token: int = 2
    moe_hidden: int | None = None  # each expert's FFN width (default: mlp_hidden)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}).")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head}).")
        if self.mlp_hidden is None:
            self.mlp_hidden = 32 * ((8 * self.n_embd // 3 + 31) // 32)
        if self.moe_hidden is None:
            self.moe_hidden = self.mlp_hidden
        if self.n_expert and not 1 <= self.n_expert_per_token <= self.n_expert:
            raise ValueError(
                f"n_expert_per_token ({self.n_expert_per_token}) must be between 1 and n_expert ({self.n_expert})."
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        norm = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return norm.type_as(x) * self.weight


def _rope_tables(cfg: GPTConfig, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.block_size, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, heads, T, head_dim); rotate pairs (even, odd).
    # cos / sin: (T, head_dim / 2) shared by the batch, or (B, T, head_dim / 2) from per-sample positions.
    # In x's dtype, as transformers' Llama applies it: fp32 tables would promote bf16 queries and keys to fp32 under
    # autocast, doubling RoPE's traffic, and attention would cast them back.
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    cos, sin = (cos[None, None], sin[None, None]) if cos.ndim == 2 else (cos[:, None], sin[:, None])
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        groups = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # Packed documents: causal within each document (mask), else plain causal.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.mlp_hidden is not None
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_hidden, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Every expert's SwiGLU weights as 3-D tensors (expert, out, in), called with the tokens, each token's chosen
    experts and their routing weights: the layout and call transformers' MoE models use."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.moe_hidden is not None
        self.num_experts = cfg.n_expert
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.n_expert, 2 * cfg.moe_hidden, cfg.n_embd))
        self.down_proj = nn.Parameter(torch.empty(cfg.n_expert, cfg.n_embd, cfg.moe_hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default for each expert's matrices: uniform in +-1/sqrt(fan_in).
        for weight in (self.gate_up_proj, self.down_proj):
            bound = weight.shape[-1] ** -0.5
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


class MoE(nn.Module):
    """Top-k routing (softmax, the chosen weights renormalized) over ``Experts``. ``aux_loss`` holds the last
    forward's load-balancing loss (Switch Transformer's n_expert x sum of token fraction x mean probability), for
    the training step to add."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k = cfg.n_expert_per_token
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.experts = Experts(cfg)
        self.aux_loss: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        n_expert = probs.shape[-1]
        fraction = torch.bincount(index.flatten(), minlength=n_expert).to(probs.dtype) / x.shape[0]
        self.aux_loss = n_expert * (fraction * probs.mean(dim=0)).sum()
        return self.experts(x, index, weights).reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp: nn.Module = MoE(cfg) if cfg.n_expert else MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Embeddings -> stack of blocks (``layers``) -> final norm -> LM head: the package's model convention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        cos, sin = _rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_parameters(self) -> None:
        # Called after meta-device materialization: rebuild the (non-persistent) rotary tables.
        self.rope_cos, self.rope_sin = _rope_tables(self.config, device=self.rope_cos.device)

    def forward(self, idx: Tensor, position_ids: Tensor | None = None, document_ids: Tensor | None = None) -> Tensor:
        """``position_ids`` (B, T): where each token sits in its sequence, when ``idx`` is not the whole sequence
        from position 0 (context parallelism hands each rank part of it), or in its document, restarting at 0 for
        each document of a packed row. ``document_ids`` (B, T): the document of each token, for packed rows.
        Attention stays within each document of a packed row (see training.documents)."""
        T = idx.shape[1]
        mask = None
        if document_ids is None and position_ids is not None and is_packed(position_ids):
            document_ids = document_ids_from_positions(position_ids)
        if document_ids is not None:
            mask = document_causal_mask(document_ids)
            if position_ids is None:
                position_ids = positions_from_documents(document_ids)
        if self.config.block_size < T:
            raise ValueError(f"Sequence length {T} exceeds block_size {self.config.block_size}.")
        for m in self.modules():  # aux_loss sums what this forward's MoE layers leave
            if isinstance(m, MoE):
                m.aux_loss = None
        x = self.tok_emb(idx)
        if position_ids is None:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        else:
            cos, sin = self.rope_cos[position_ids], self.rope_sin[position_ids]
        for layer in self.layers:
            x = layer(x, cos, sin) if mask is None else layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))

    def aux_loss(self) -> Tensor:
        """The MoE layers' load-balancing losses of the last forward, summed (0 for a dense model)."""
        losses = [m.aux_loss for m in self.modules() if isinstance(m, MoE) and m.aux_loss is not None]
        if self.config.n_expert and len(losses) != self.config.n_layer:
            raise EarlierStageState(
                f"The load-balancing loss sums every MoE layer's, but the last forward ran {len(losses)} of"
                f" {self.config.n_layer} here: under pipeline parallelism each stage runs its own layers and only the"
                " last computes the loss. Set moe_aux_loss_coef=0 with pipeline_parallel > 1, or train this MoE with"
                " expert, tensor and data parallelism."
            )
        return torch.stack(losses).sum() if losses else self.lm_head.weight.new_zeros(())
