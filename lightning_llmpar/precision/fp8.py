"""FP8 training: swap suitable ``nn.Linear`` modules for torchao's ``Float8Linear`` before parallelization.

The swap must come first: tensor parallelism and FSDP2 shard the parameters of the modules they find,
and torchao's float8 all-gather only exists for weights that were Float8Linear when ``fully_shard`` ran.
Parameter names do not change (a Float8Linear keeps ``weight``/``bias``), so checkpoints stay
interchangeable with bf16/fp32 runs.
"""

from __future__ import annotations

from torch import nn

from lightning_llmpar.modeling.structure import find_block_stack

__all__ = ["convert_to_fp8", "fp8_candidates", "skip_patterns"]

_FP8_MULTIPLE = 16  # FP8 matmul kernels need both dimensions divisible by 16


def skip_patterns(skip: str | list[str] | None) -> list[str]:
    """``skip`` as a list of name substrings: one string is one pattern (iterated, its letters were the patterns)."""
    return [skip] if isinstance(skip, str) else list(skip or [])


def fp8_candidates(model: nn.Module, *, keep_first_last: bool = True, skip: str | list[str] | None = None) -> list[str]:
    """Names of the linears that run in FP8: right shape, not skipped, weight not tied to another module's (an LM
    head sharing the embedding: torchao gives a converted layer a weight of its own, which would untie it), and
    (by default) not in the first or last block or outside the block stack (LM head, input projections)."""
    return _sort_linears(model, keep_first_last, skip_patterns(skip))["chosen"]


def _sort_linears(model: nn.Module, keep_first_last: bool, skip: list[str]) -> dict[str, list[str]]:
    """Every ``nn.Linear`` by what decides it: 'shape', 'skip', 'tied', 'kept' (first/last block, outside), 'chosen'."""
    stack = find_block_stack(model)
    names = stack.names() if stack is not None else []
    protected = {names[0], names[-1]} if keep_first_last and len(names) > 0 else set()
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    sorted_: dict[str, list[str]] = {k: [] for k in ("shape", "skip", "tied", "kept", "chosen")}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        block = next((b for b in names if name.startswith(b + ".")), None)
        if module.in_features % _FP8_MULTIPLE or module.out_features % _FP8_MULTIPLE:
            kind = "shape"
        elif any(pattern in name for pattern in skip):
            kind = "skip"
        elif uses.get(id(module.weight), 0) > 1:
            kind = "tied"
        elif keep_first_last and (block is None or block in protected):
            kind = "kept"
        else:
            kind = "chosen"
        sorted_[kind].append(name)
    return sorted_


def convert_to_fp8(
    model: nn.Module,
    recipe: str,
    *,
    float8_all_gather: bool,
    keep_first_last: bool = True,
    skip: str | list[str] | None = None,
) -> list[str]:
    """Convert in place; returns the converted module names. Raises if nothing qualifies."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ImportError("FP8Precision needs torchao: pip install 'lightning_llmpar[fp8]'.") from err

    linears = _sort_linears(model, keep_first_last, skip_patterns(skip))
    chosen = set(linears["chosen"])
    if not chosen:
        why = {
            "shape": f"with a dimension not divisible by {_FP8_MULTIPLE}, which FP8 matmuls need (a width such as"
                     " a multiple of 16 fixes it)",
            "skip": "named by `skip`",
            "tied": "whose weight is tied to another module's (an LM head sharing the embedding), kept to stay tied",
            "kept": "in the first or last block or outside the block stack, which keep_first_last=True keeps in higher"
                    " precision (keep_first_last=False converts them)",
        }
        found = "; ".join(f"{len(v)} {why[k]} (e.g. {v[0]!r})" for k, v in linears.items() if v and k in why)
        raise ValueError(f"FP8Precision found no linear layer to convert in {type(model).__name__}: of its linears, "
                         f"{found or 'none exist'}.")
    # Float8 all-gather exists for tensorwise scaling only (FP8Precision refuses other pairings).
    config = (
        Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        if float8_all_gather
        else Float8LinearConfig.from_recipe_name(recipe)
    )
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen)
    return sorted(chosen)
