"""Models from outside the Llama mould, written as other libraries write them (dict batches, one device)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from tests.titan_models import TitanLM

VOCAB, WIDTH = 64, 32


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Residual(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class _Base(LightningModule):
    def __init__(self, name: str = "", lr: float = 0.5, sgd: bool = True, **_: Any) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.lr = lr

    def body(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.head(self.norm(self.body(self.emb(batch["input_ids"]))))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Containers(_Base):
    """Layers as ModuleList containers [norm, block, residual] without a forward, iterated by the parent."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.layers = nn.ModuleList(nn.ModuleList([nn.LayerNorm(WIDTH), _MLP(), _Residual()]) for _ in range(4))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for norm, block, residual in self.layers:
            x = residual(x, block(norm(x)))
        return x


class _TypedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(WIDTH), _MLP()
        self.scale = {"wide": 1.0, "narrow": 0.5}

    def forward(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return x + self.scale[kind] * self.mlp(self.norm(x))


class Zipped(_Base):
    """A forward that walks a per-layer list beside the blocks, by position."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.layers = nn.ModuleList(_TypedBlock() for _ in range(4))
        self.layer_types = ["wide", "narrow", "narrow", "wide"]

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for kind, layer in zip(self.layer_types, self.layers):
            x = layer(x, kind)
        return x


class ReadsItsOptimizer(Zipped):
    """A step that logs its learning rate from its optimizer and its schedule, as users do."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        self.log("scheduled_lr", self.lr_schedulers().get_last_lr()[0])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)}


class _SequentialBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(WIDTH), _MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class SequentialStack(_Base):
    """Blocks in an ``nn.Sequential`` the forward calls whole (``self.blocks(x)``), as minimal GPTs write it."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.blocks = nn.Sequential(*(_SequentialBlock() for _ in range(4)))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused c_attn, rows [all q; all k; all v]; the width read from the input unless
    ``own_width`` (then from the module, as forks of it write it)."""

    def __init__(self, own_width: bool) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.n_head, self.n_embd, self.own_width = 4, WIDTH, own_width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # noqa: N806 - nanoGPT's names
        if self.own_width:
            C = self.n_embd  # noqa: N806
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class _NanoMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class _NanoBlock(nn.Module):
    def __init__(self, own_width: bool) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(WIDTH), CausalSelfAttention(own_width), nn.LayerNorm(WIDTH)
        self.mlp = _NanoMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(_Base):
    """nanoGPT's blocks in ``transformer.h``; ``nanogpt_own_width``: its attention reshapes with ``self.n_embd``."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.transformer = nn.ModuleDict({"h": nn.ModuleList(_NanoBlock(name == "nanogpt_own_width") for _ in range(2))})

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.transformer.h:
            x = block(x)
        return x


class Indexed(Zipped):
    """A forward that indexes its blocks: ``for i in range(len(self.layers)): self.layers[i](...)``."""

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.layers)):
            x = self.layers[i](x, self.layer_types[i])
        return x


class ReusesEmbedding(Zipped):
    """Every block also adds the embedding output: a value from before the stack, used after it."""

    def body(self, x: torch.Tensor) -> torch.Tensor:
        first = x
        for kind, layer in zip(self.layer_types, self.layers):
            x = layer(x, kind) + 0.1 * first
        return x


class Unchained(Zipped):
    """Blocks applied side by side to the embedding, not one after another."""

    def body(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for kind, layer in zip(self.layer_types, self.layers):
            out = layer(x, kind)
        return out


class _StateBlock(nn.Module):
    """Returns (output, state) and reads the state of the block before it when ``shared`` (GLM-5's sparse-attention
    layers that reuse the previous layer's top-k indices). It counts its positive inputs as a number (as routers
    count tokens per expert), which the meta device cannot run, and refuses non-finite inputs."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.shared, self.norm, self.mlp = shared, nn.LayerNorm(WIDTH), _MLP()

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        self.positive = int((x.detach() > 0).sum())
        if not bool(torch.isfinite(x).all()):
            raise FloatingPointError("non-finite activations")
        if self.shared and prev is None:
            raise ValueError("a shared block needs the state of the block before it")
        state = prev if self.shared and prev is not None else torch.tanh(x.mean(-1, keepdim=True))
        return x + self.mlp(self.norm(x)) * (1 + state), state


class PassesState(_Base):
    """Blocks that hand the next one a second value, which every other block reuses."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.layers = nn.ModuleList(_StateBlock(shared=i % 2 == 1) for i in range(4))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        state = None
        for layer in self.layers:
            x, state = layer(x, state)
        return x


class _SideBlock(nn.Module):
    """A block that also reads the embeddings through its own projection, a little (Zamba's shared attention
    takes them concatenated to its input): its output moves by ~1e-7, its projection's gradient comes only from it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp, self.side = nn.LayerNorm(WIDTH), _MLP(), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x)) + 1e-7 * self.side(first)


class ReadsEmbedding(_Base):
    """Every block reads the embeddings too: a value from before the stack that the comparison alone misses."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.layers = nn.ModuleList(_SideBlock() for _ in range(4))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        first = x
        for layer in self.layers:
            x = layer(x, first)
        return x


class _GatedSideBlock(_SideBlock):
    """Reads the embeddings through a scale initialized to zero (Gemma-3n's per-layer inputs enter through
    ``correct_output_scale``): its output does not move at all, only the scale's gradient sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x)) + self.scale * self.side(first)


class ReadsGatedEmbedding(ReadsEmbedding):
    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.layers = nn.ModuleList(_GatedSideBlock() for _ in range(4))


class _Gentle(nn.Module):
    """A block that moves its input only a little (``rate``), as a looped model's blocks do at initialization."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate, self.norm, self.mlp = rate, nn.LayerNorm(WIDTH), _MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.rate * self.mlp(self.norm(x))


class Looped(_Base):
    """A recurrent-depth forward: one input block, the middle two run twice, one output block. Its blocks move the
    activations so little that a split which runs the loop once computes a loss within 1e-4 of the model's."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.layers = nn.ModuleList(_Gentle(1.0 if i in (0, 3) else 1e-4) for i in range(4))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        for _ in range(2):
            for layer in self.layers[1:3]:
                x = layer(x)
        return self.layers[3](x)


class CalledTwice(Zipped):
    """An ordinary model whose step calls it twice (a preference loss over a chosen and a rejected sequence)."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        rejected = {"input_ids": batch["input_ids"].flip(1), "labels": batch["labels"].flip(1)}
        return super().training_step(batch, batch_idx) - 0.1 * super().training_step(rejected, batch_idx)


class ShiftedLM(LightningModule):
    """A user's step on dict batches for a model that returns logits: next-token cross-entropy, shifted by hand,
    plus ``extra_loss()``; SGD (a wrong gradient scale shows in the loss) or AdamW."""

    model: nn.Module

    def __init__(self, lr: float = 0.5, sgd: bool = True) -> None:
        super().__init__()
        self.lr, self.sgd = lr, sgd

    def extra_loss(self) -> torch.Tensor | float:
        return 0.0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        labels = batch["labels"]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1)) + self.extra_loss()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.sgd:
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class GPTMoE(ShiftedLM):
    """The package's example GPT with mixture-of-experts MLPs (4 experts, top-2); ``aux`` adds the load-balancing
    loss."""

    def __init__(self, name: str = "", lr: float = 0.5, sgd: bool = True, aux: float = 0.0, **_: Any) -> None:
        super().__init__(lr, sgd)
        from lightning_llmpar.models.gpt import GPT, GPTConfig

        self.model = GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=4, n_head=4, n_kv_head=2, n_embd=WIDTH,
                                   n_expert=4, n_expert_per_token=2, moe_hidden=48))
        self.aux = aux

    def extra_loss(self) -> torch.Tensor | float:
        return self.aux * self.model.aux_loss() if self.aux else 0.0


class OwnPositions(Zipped):
    """Learned positions as a parameter of the model itself (timm's ViT), beside its blocks."""

    def __init__(self, name: str = "", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.pos = nn.Parameter(torch.randn(64, WIDTH) * 0.02)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return super().body(x + self.pos[: x.shape[1]])


class NotCausal(LightningModule):
    """transformers models whose labels are every target, not the inputs shifted by the loss: an encoder-decoder
    (T5, whose decoder reads the labels shifted right) and a masked LM (BERT), on the causal LMs' dict batches."""

    def __init__(self, name: str = "", lr: float = 0.5, **_: Any) -> None:
        super().__init__()
        import transformers

        self.lr = lr
        if name == "t5":
            self.model = transformers.T5ForConditionalGeneration(transformers.T5Config(
                vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                decoder_start_token_id=0, pad_token_id=0))
        else:
            self.model = transformers.BertForMaskedLM(transformers.BertConfig(
                vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Distilled(LightningModule):
    """Knowledge distillation: a student trained on the KL to a frozen teacher twice its width, both transformers
    Llamas in one module. The teacher runs first ("distilled_teacher_first") or after the student."""

    def __init__(self, name: str = "", lr: float = 0.5, **_: Any) -> None:
        super().__init__()
        import transformers

        def llama(width: int) -> nn.Module:
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))

        self.lr, self.teacher_first = lr, name.endswith("teacher_first")
        self.student, self.teacher = llama(WIDTH), llama(2 * WIDTH).requires_grad_(False)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        if self.teacher_first:
            with torch.no_grad():
                teacher = self.teacher(input_ids=ids).logits
        student = self.student(input_ids=ids).logits
        if not self.teacher_first:
            with torch.no_grad():
                teacher = self.teacher(input_ids=ids).logits
        kl = F.kl_div(F.log_softmax(student / 2, -1), F.log_softmax(teacher / 2, -1), log_target=True, reduction="none")
        return kl.sum(-1).mean() * 4

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


CUSTOM = {"containers": Containers, "zipped": Zipped, "indexed": Indexed, "reuses_embedding": ReusesEmbedding, "unchained": Unchained,
          "passes_state": PassesState, "looped": Looped, "called_twice": CalledTwice, "sequential": SequentialStack, "reads_embedding": ReadsEmbedding,
          "nanogpt": NanoGPT, "nanogpt_own_width": NanoGPT,
          "reads_gated_embedding": ReadsGatedEmbedding,
          "gpt_moe": GPTMoE, "titan_tied": TitanLM, "titan_untied": TitanLM,
          "titan_named": TitanLM, "titan_from1": TitanLM, "t5": NotCausal, "bert_mlm": NotCausal,
          "own_positions": OwnPositions, "distilled": Distilled, "reads_its_optimizer": ReadsItsOptimizer,
          "distilled_teacher_first": Distilled}
