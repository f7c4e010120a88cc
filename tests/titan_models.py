"""A Llama written as torchtitan writes its models, wrapped as a Lightning user would.

The blocks live in an ``nn.ModuleDict`` keyed "0".."N-1" (torchtitan's pipeline stages delete entries so that
parameter names stay the whole model's) and the forward walks ``layers.values()``, handing every block the rotary
table (complex ``freqs_cis``) it computed once; RMSNorm, grouped-query attention with separate wq/wk/wv/wo, a SwiGLU
feed-forward w1/w2/w3, an output head tied to the embedding or not. The step takes ``(inputs, targets)`` pairs
(targets already shifted), which context parallelism can cut along the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

__all__ = ["TitanLM", "Transformer", "TransformerModelArgs"]


@dataclass
class TransformerModelArgs:
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 64
    hidden_dim: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 32
    tied: bool = False
    keys: tuple[str, ...] | None = None  # the ModuleDict's keys (torchtitan's: "0".."N-1")


def precompute_freqs_cis(dim: int, end: int, theta: float) -> Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # (end, dim / 2), complex64


def apply_rotary_emb(xq: Tensor, xk: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor]:
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    # (T, d/2) for a whole sequence, (B, T, d/2) for given positions: broadcast over the heads.
    freqs = freqs_cis.unsqueeze(-2) if freqs_cis.dim() == 3 else freqs_cis[None, :, None, :]
    return torch.view_as_real(q * freqs).flatten(3).type_as(xq), torch.view_as_real(k * freqs).flatten(3).type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        bs, seqlen, _ = x.shape
        # -1: the local number of heads when tensor parallelism splits the projections (as torchtitan's forward).
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        repeats = self.n_heads // self.n_kv_heads
        xk, xv = xk.repeat_interleave(repeats, dim=2), xv.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len,
                                                              args.rope_theta), persistent=False)
        keys = args.keys or [str(i) for i in range(args.n_layers)]
        self.layers = nn.ModuleDict({key: TransformerBlock(args) for key in keys})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: Tensor, position_ids: Tensor | None = None) -> Tensor:
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]] if position_ids is None else self.freqs_cis[position_ids]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


class TitanLM(LightningModule):
    """``name`` ending in "_tied": the head shares the embedding's weight; "titan_named" / "titan_from1": the
    ModuleDict keyed by names ("blk_a".."blk_d") / from "1"."""

    batch_pairs = True  # the zoo's data as (inputs, shifted targets)

    def __init__(self, name: str = "titan", lr: float = 0.5, sgd: bool = True, **_: Any) -> None:
        super().__init__()
        self.lr, self.sgd = lr, sgd
        keys = {"titan_named": tuple(f"blk_{c}" for c in "abcd"), "titan_from1": tuple("1234")}.get(name)
        self.model = Transformer(TransformerModelArgs(tied=name.endswith("_tied"), keys=keys))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
        self.log("train_loss", loss)
        self.log("train_z", torch.logsumexp(logits.detach(), -1).pow(2).mean())  # a value besides the loss (z-loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.sgd:
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
