"""What the plan needs to know about real models: projection names, and fused layouts by attention class.

Names are matched on a module's direct children (case-insensitive). Fused q/k/v projections cannot be
recognised by shape alone (GPT-NeoX's per-head ``[q_h; k_h; v_h]`` and GPT-2's ``[all q | all k | all v]``
look alike), so their layout is looked up by the attention class that owns them; anything else fused is
refused with the ``tp_plan`` entry that describes it (see docs/model-convention.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_llmpar.modeling.packing import Packing

__all__ = [
    "Q", "K", "V", "OUT", "UP", "DOWN", "FUSED_QKV", "FUSED_UP", "HEAD_COUNT_ATTRS", "KV_COUNT_ATTRS", "WIDTH_ATTRS",
    "INTERLEAVED_EXPERTS", "STACKED_EXPERTS", "PAIRED_HALVES", "HEADS_TO_HEADS", "RETURNED_BIAS",
    "FusedLayout", "fused_qkv_layout", "head_slices", "name_roles", "out_features",
]

Q = {"q_proj", "q", "wq", "query", "q_lin", "to_q"}
K = {"k_proj", "k", "wk", "key", "k_lin", "to_k"}
V = {"v_proj", "v", "wv", "value", "v_lin", "to_v"}
OUT = {"o_proj", "out_proj", "wo", "o", "proj", "c_proj", "dense", "out_lin", "to_out"}
# An attention's output gate, multiplied with the heads' output before the output projection.
ATTN_GATE = {"gate_proj", "g_proj"}
FUSED_QKV = {"qkv", "qkv_proj", "c_attn", "wqkv", "query_key_value", "in_proj", "w_pack"}
UP = {"up_proj", "gate_proj", "w1", "w3", "fc1", "c_fc", "fc_in", "gate", "up", "dense_h_to_4h", "lin1", "fc_1", "fc_2", "fc"}
DOWN = {"down_proj", "w2", "fc2", "fc_out", "c_proj", "down", "dense_4h_to_h", "lin2", "proj", "output_linear"}
FUSED_UP = {"gate_up_proj", "w13", "fc1_gate", "input_linear"}
# Fused experts whose gate_up columns alternate [g0, u0, g1, u1, ...], for transformers versions that do not mark
# them (is_concatenated=False).
INTERLEAVED_EXPERTS = {"GptOssExperts"}
# Experts stored as 2-D weights, each expert's FFN rows stacked (experts x FFN, hidden), viewed per expert by the
# forward with an FFN-width attribute (DBRX): class -> (the child holding them, the weights, the module's FFN-width
# and expert-count attributes).
STACKED_EXPERTS = {"DbrxExperts": ("mlp", ("w1", "v1", "w2"), "ffn_hidden_size", "num_experts")}
# Differential attentions: head h is paired with head h + heads/2 (values: the two halves of the key/value heads),
# so q, k and v split per half and each rank holds whole pairs.
PAIRED_HALVES = {"DiffLlamaAttention"}
# Projections inside an attention that read all key/value heads' values and give one value per key/value head
# (Doge's dynamic mask, dt_proj): split by rows, the sum over ranks scattered so each rank gets its own heads'.
HEADS_TO_HEADS = {"DogeAttention": ("dt_proj",)}
# An attention's own parameter its forward returns for the block to add after the output projection, a row split's
# bias in all but name (GPT-NeoX-Japanese's dense_bias): kept whole.
RETURNED_BIAS = {"GPTNeoXJapaneseAttention": ("dense_bias",)}

# Attributes an attention module (or its own config) may read to reshape into heads; they hold per-rank
# counts after TP.
HEAD_COUNT_ATTRS = (
    "num_heads", "n_heads", "n_head", "num_attention_heads", "n_local_heads",
    "num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "n_local_kv_heads", "n_query_groups",
)
# Those of them that count key/value heads (fewer than the ranks: each rank holds one, see shared_heads.py).
KV_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "n_local_kv_heads", "n_query_groups")
# Width attributes (heads x head_dim) some attention modules reshape or split with.
WIDTH_ATTRS = ("hidden_size", "embed_dim", "all_head_size", "inner_dim", "n_embd", "split_size")


def out_features(module: nn.Module) -> int:
    weight = module.weight  # type: ignore[union-attr]
    return weight.shape[1] if type(module).__name__ == "Conv1D" else weight.shape[0]


def _in_features(module: nn.Module) -> int:
    weight = module.weight  # type: ignore[union-attr]
    return weight.shape[0] if type(module).__name__ == "Conv1D" else weight.shape[1]


def name_roles(children: dict[str, nn.Module], head_dim: int | None = None) -> dict[str, str]:
    """Roles of a module's linear children by their names: 'col' / 'qkv' / 'gate_up' / 'row', or none.
    ``head_dim``: the attention's, if it has one (a gate with one value per head is split with the heads)."""
    lower = {n.lower(): n for n in children}
    roles: dict[str, str] = {}
    if lower.keys() & FUSED_QKV or (lower.keys() & Q and lower.keys() & K and lower.keys() & V):
        q_width = next((out_features(children[n]) for low, n in lower.items() if low in Q), None)
        gate_widths = {q_width, q_width // head_dim} if q_width and head_dim else {q_width}
        for low, n in lower.items():
            if low in Q | K | V:
                roles[n] = "col"
            elif low in ATTN_GATE and out_features(children[n]) in gate_widths:
                # An output gate with one value per feature of every head (AFMoE) or per head (LFM3): split with q.
                roles[n] = "col"
            elif low in FUSED_QKV:
                roles[n] = "qkv"
            elif low in OUT:
                roles[n] = "row"
    elif (lower.keys() & (UP | FUSED_UP)) and lower.keys() & DOWN:
        downs = [children[n] for low, n in lower.items() if low in DOWN]
        for low, n in lower.items():
            if low in FUSED_UP:
                # [gate; up] halves only if the down projection reads half of it: an MLP without a gate may
                # use the name too (Granite's input_linear), and halves split apart would be wrong for it.
                whole = any(_in_features(d) == out_features(children[n]) for d in downs)
                roles[n] = "col" if whole else "gate_up"
            elif low in UP:
                roles[n] = "col"
            elif low in DOWN:
                roles[n] = "row"
    return roles


@dataclass(frozen=True)
class FusedLayout:
    """How a fused q/k/v projection splits: ``packing`` (None: rows already grouped per head or per key/value
    group, so a plain column split hands each rank whole heads), the head counts to patch per rank, and other
    attributes the forward splits with, by their per-rank values (``patch``)."""

    packing: Packing | None
    heads: int
    kv_heads: int
    patch: tuple[tuple[str, int], ...] = ()


def _concat(attn: nn.Module, tp: int, dim: int, q: int, kv: int, head_dim: int) -> FusedLayout:
    return FusedLayout(Packing(dim, (q * head_dim, kv * head_dim, kv * head_dim), tp), q, kv)


def _gpt2(attn: nn.Module, tp: int) -> FusedLayout:
    # c_attn is a Conv1D (weight (in, out)); its output columns are [all q | all k | all v].
    return _concat(attn, tp, 1, attn.num_heads, attn.num_heads, attn.head_dim)


def _openai_gpt(attn: nn.Module, tp: int) -> FusedLayout | None:
    # OpenAI GPT's ``Attention``: a Conv1D c_attn whose output columns are [all q | all k | all v], as GPT-2's.
    if not type(attn).__module__.endswith("openai.modeling_openai"):
        return None  # another library's class of the same name
    return _concat(attn, tp, 1, attn.n_head, attn.n_head, attn.split_size // attn.n_head)


def _mpt(attn: nn.Module, tp: int) -> FusedLayout:
    # Wqkv rows [all q; all k; all v], chunked in three by the forward.
    return _concat(attn, tp, 0, attn.n_heads, attn.n_heads, attn.head_dim)


def _dbrx(attn: nn.Module, tp: int) -> FusedLayout:
    # Wqkv rows [all q; all k; all v] with grouped key/value heads, split by the forward with hidden_size.
    return _concat(attn, tp, 0, attn.num_heads, attn.num_key_value_heads, attn.head_dim)


def _gpt_bigcode(attn: nn.Module, tp: int) -> FusedLayout:
    if attn.multi_query:  # rows [all q; k; v] with one key/value head, shared by the ranks
        return _concat(attn, tp, 0, attn.num_heads, 1, attn.head_dim)
    return FusedLayout(None, attn.num_heads, attn.num_heads)  # per head [q_h; k_h; v_h]


def _phi3(attn: nn.Module, tp: int) -> FusedLayout:
    # qkv_proj rows [all q; all k; all v], split by the forward with config.num_attention_heads.
    return _concat(attn, tp, 0, attn.config.num_attention_heads, attn.num_key_value_heads, attn.head_dim)


def _codegen(attn: nn.Module, tp: int) -> FusedLayout:
    # qkv_proj rows are mp_num groups of [q; v; k], each group a run of whole heads, viewed by the forward as
    # (mp_num, 3 * width / mp_num): a plain column split hands each rank whole groups if tp divides mp_num.
    if attn.mp_num % tp:
        raise ValueError(
            f"CodeGen's qkv_proj is fused in mp_num={attn.mp_num} groups of [q; v; k]; tensor_parallel({tp}) would"
            f" cut a group apart. Use a tensor_parallel degree that divides {attn.mp_num}."
        )
    heads = attn.num_attention_heads
    return FusedLayout(None, heads, heads, (("mp_num", attn.mp_num // tp),))


def _per_head(attn: nn.Module, tp: int) -> FusedLayout:
    # GPT-NeoX, GPT-NeoX-Japanese, Bloom, Persimmon: rows [q_h; k_h; v_h] per head.
    heads = getattr(attn, "num_heads", None) or getattr(attn, "num_attention_heads", None)
    heads = heads or attn.config.num_attention_heads
    return FusedLayout(None, heads, heads)


def _falcon(attn: nn.Module, tp: int) -> FusedLayout:
    if attn.new_decoder_architecture and attn.num_kv_heads > 1:  # rows [q heads of the group; k; v] per group
        return FusedLayout(None, attn.num_heads, attn.num_kv_heads)
    if not attn.multi_query:  # per head [q_h; k_h; v_h]
        return FusedLayout(None, attn.num_heads, attn.num_heads)
    return _concat(attn, tp, 0, attn.num_heads, 1, attn.head_dim)  # one key/value head (one group): [all q; k; v]


def _causal_self_attention(attn: nn.Module, tp: int) -> FusedLayout | None:
    config = getattr(attn, "config", None)
    if config is not None and hasattr(config, "n_query_groups"):
        # LitGPT: qkv rows [all q; all k; all v], split with config.n_head / n_query_groups / head_size.
        return _concat(attn, tp, 0, config.n_head, config.n_query_groups, config.head_size)
    if isinstance(getattr(attn, "n_head", None), int) and isinstance(getattr(attn, "n_embd", None), int):
        # nanoGPT: c_attn rows [all q; all k; all v], split with n_embd.
        _check_nanogpt_reshapes(attn, tp)
        return _concat(attn, tp, 0, attn.n_head, attn.n_head, attn.n_embd // attn.n_head)
    return None


def _check_nanogpt_reshapes(attn: nn.Module, tp: int) -> None:
    """nanoGPT's and minGPT's forward read the width from their input (``B, T, C = x.size()``, then
    ``view(B, T, n_head, C // n_head)``), which stays whole while a rank holds ``n_head / tp`` heads: the first step
    would fail in the reshape. Proven here on a meta-device copy of the attention (no memory, no data), with the
    whole widths and with one rank's, before anything is split."""
    c_attn, c_proj = getattr(attn, "c_attn", None), getattr(attn, "c_proj", None)
    if not isinstance(c_attn, nn.Linear) or not isinstance(c_proj, nn.Linear):
        return
    width = attn.n_embd

    def runs(ranks: int) -> bool:
        try:
            memo: dict[int, object] = {id(t): torch.empty_like(t, device="meta") for t in attn.buffers()}
            memo.update({id(p): nn.Parameter(torch.empty_like(p, device="meta")) for p in attn.parameters()})
            probe = copy.deepcopy(attn, memo)
            probe.n_head, probe.n_embd = attn.n_head // ranks, width // ranks
            probe.c_attn = nn.Linear(width, 3 * width // ranks, bias=c_attn.bias is not None, device="meta")
            probe.c_proj = nn.Linear(width // ranks, width, bias=c_proj.bias is not None, device="meta")
            probe(torch.empty(1, 2, width, device="meta"))
        except Exception:  # noqa: BLE001 - a module this probe cannot copy or call proves nothing either way
            return False
        return True

    if runs(1) and not runs(tp):
        raise ValueError(
            f"{type(attn).__name__} reads its width from its input (`B, T, C = x.size()`, then `C // self.n_head`),"
            f" which tensor parallelism keeps whole ({width}) while each rank holds {attn.n_head // tp} of its"
            f" {attn.n_head} heads: its reshape would fail at the first step. Reshape with the module's own width"
            " instead (`C // self.n_head` -> `self.n_embd // self.n_head`, `view(B, T, C)` -> `view(B, T,"
            " self.n_embd)`: the strategy gives each rank its n_head and n_embd), or keep the attention whole and"
            " split the MLP: sequence_parallel=False, tp_plan={'<blocks>.*.attn.c_attn': 'replicate',"
            " '<blocks>.*.attn.c_proj': 'replicate'} (docs/model-convention.md)."
        )


FUSED_QKV_LAYOUTS: dict[str, Callable[[nn.Module, int], FusedLayout | None]] = {
    "CausalSelfAttention": _causal_self_attention,
    "GPT2Attention": _gpt2,
    "Phi3Attention": _phi3,
    "GPTNeoXAttention": _per_head,
    "GPTNeoXJapaneseAttention": _per_head,
    "BloomAttention": _per_head,
    "PersimmonAttention": _per_head,
    "FalconAttention": _falcon,
    "Attention": _openai_gpt,
    "MptAttention": _mpt,
    "DbrxAttention": _dbrx,
    "CodeGenAttention": _codegen,
    "GPTBigCodeAttention": _gpt_bigcode,
}


def fused_qkv_layout(attn: nn.Module, tp: int) -> FusedLayout | None:
    fn = FUSED_QKV_LAYOUTS.get(type(attn).__name__)
    return fn(attn, tp) if fn is not None else None


def head_slices(attn: nn.Module) -> dict[str, tuple[int, int, bool]]:
    """Per-head tensors an attention receives for all heads (ALiBi): argument -> (heads, dim, batch_major)."""
    name = type(attn).__name__
    if name == "BloomAttention":
        return {"alibi": (attn.num_heads, 0, True)}
    if name == "MptAttention":  # ALiBi biases (heads, queries, keys)
        return {"position_bias": (attn.n_heads, 0, False)}
    if name == "FalconAttention" and getattr(attn.config, "alibi", False):
        return {"alibi": (attn.num_heads, 1, False), "attention_mask": (attn.num_heads, 1, False)}
    return {}
