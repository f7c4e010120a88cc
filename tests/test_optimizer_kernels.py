"""Optimizer kernels: which groups LLMParallelStrategy switches to torch's fused Adam/AdamW, which it leaves, and
that a checkpoint's parameter groups do not switch them back. (Fused against the loop, layout by layout, is
compared with one process in tests/test_parity.py.)"""

from __future__ import annotations

import torch
from torch import nn

from lightning_llmpar.training.optimizer import apply_optimizer_kernels, keep_kernels


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    model(torch.randn(3, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_groups_left_to_torch_are_fused_and_choices_are_kept() -> None:
    model = _model()
    params = list(model.parameters())
    optimizers = [
        torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:4], "foreach": False}], lr=1e-2),
        torch.optim.Adam(params[4:], lr=1e-2, fused=False),
        torch.optim.SGD(params, lr=1e-2),
    ]
    assert apply_optimizer_kernels(optimizers, model) == {"fused": 1, "loop": 0}
    groups = [g for opt in optimizers for g in opt.param_groups]
    assert [(g["fused"], g["foreach"]) for g in groups] == [(True, None), (None, False), (False, None), (None, None)]
    assert apply_optimizer_kernels([torch.optim.AdamW(params, lr=1e-2)], model, fused=False) == {"fused": 0, "loop": 0}


def test_fused_adamw_matches_the_loop() -> None:
    finals = []
    for fuse in (False, True):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        apply_optimizer_kernels([optimizer], model, fused=fuse)
        torch.manual_seed(1)
        for _ in range(5):
            _step(optimizer, model)
        finals.append([p.detach().clone() for p in model.parameters()])
    for loop, fused in zip(*finals):
        torch.testing.assert_close(fused, loop, atol=1e-6, rtol=0)


def test_resuming_keeps_this_runs_kernels() -> None:
    model = _model()
    saved = torch.optim.AdamW(model.parameters(), lr=1e-2)  # a checkpoint written with torch's choice
    _step(saved, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    apply_optimizer_kernels([optimizer], model)
    with keep_kernels([optimizer]):
        optimizer.load_state_dict(saved.state_dict())
        assert optimizer.param_groups[0]["fused"] is None  # what the checkpoint's groups carry
    assert optimizer.param_groups[0]["fused"] is True
    assert all(s["step"].dtype == torch.float32 and s["step"].item() == 1 for s in optimizer.state.values())
    _step(optimizer, model)
    assert all(s["step"].item() == 2 for s in optimizer.state.values())
