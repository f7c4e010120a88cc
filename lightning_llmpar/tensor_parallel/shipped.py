"""Plans a model ships: transformers' ``config.base_model_tp_plan``, read as roles for our own splits.

A shipped plan names which projections split by columns and which by rows; we take those roles (they
know names our tables may not) and still choose the styles ourselves: sequence parallelism, fused
projections split per piece instead of gathered (``colwise_gather_output`` on Phi-3's ``qkv_proj`` becomes
a per-head split), per-head norms with summed gradients, MoE experts split along their FFN width.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

__all__ = ["ROLE_OF_STYLE", "shipped_roles"]

# transformers style name -> our role for that module (or parameter).
ROLE_OF_STYLE = {
    "colwise": "col",
    "colwise_gather_output": "col",
    "colwise_rep": "col",
    "packed_colwise": "col",
    "rowwise": "row",
    "rowwise_split_input": "row",
    "rowwise_rep": "row",
    "replicated_with_grad_allreduce": "headwise",
    "moe_tp_experts": "experts",
    "embedding_rowwise": "embedding",
    "sequence_parallel": "norm",
    "replicate": "replicate",
}


def shipped_roles(model: nn.Module) -> dict[str, str]:
    """Full module (or parameter) name -> role, from every transformers base model inside ``model``."""
    roles: dict[str, str] = {}
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    for prefix, module in model.named_modules():
        config = getattr(module, "config", None)
        plan = getattr(config, "base_model_tp_plan", None)
        if not plan or getattr(module, "base_model", None) is not module:
            continue
        for pattern, style in plan.items():
            role = ROLE_OF_STYLE.get(style)
            if role is None:
                continue  # a style we do not map: structural inference decides for that module
            full = f"{prefix}.{pattern}" if prefix else pattern
            for name in names:
                if fnmatchcase(name, full):
                    roles.setdefault(name, role)
    return roles
