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
    assert apply_optimizer_kernels(optimizers, model) == {"fused": 1, "split": 0, "loop": 0}
    groups = [g for opt in optimizers for g in opt.param_groups]
    assert [(g["fused"], g["foreach"]) for g in groups] == [(True, None), (None, False), (False, None), (None, None)]
    assert apply_optimizer_kernels([torch.optim.AdamW(params, lr=1e-2)], model, fused=False) == {"fused": 0, "split": 0, "loop": 0}


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


def _mixed_group_run(split: bool) -> dict:
    # Tensor parallelism without FSDP2 leaves plain tensors and DTensors in one group; a one-rank mesh makes
    # the DTensors here.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from lightning_llmpar.training.optimizer import group_kernels

    model = _model()
    if split:
        mesh = init_device_mesh("cpu", (1,))
        for name in ("weight", "bias"):
            setattr(model[0], name, nn.Parameter(distribute_tensor(getattr(model[0], name).detach(), mesh, [Replicate()])))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    counts = apply_optimizer_kernels([optimizer], model, fused=split)
    seen = []
    optimizer.register_step_pre_hook(lambda opt, *_: seen.append([(len(g["params"]), g["fused"]) for g in opt.param_groups]))
    torch.manual_seed(1)
    for _ in range(4):
        x = torch.randn(3, 4)
        h = model[0](DTensor.from_local(x, mesh, [Replicate()])).to_local() if split else model[0](x)
        model[2](model[1](h)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return {"counts": counts, "kernels": group_kernels(optimizer), "seen": seen, "groups": len(optimizer.param_groups),
            "saved_groups": len(optimizer.state_dict()["param_groups"]), "lr": optimizer.param_groups[0]["lr"],
            "params": [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]}


def test_a_group_mixing_plain_tensors_and_dtensors_steps_fused_per_kind() -> None:
    from tests.distributed import run_ranks

    split = run_ranks(_mixed_group_run, 1, True)[0]
    loop = _mixed_group_run(False)
    assert split["counts"] == {"fused": 0, "split": 1, "loop": 0} and split["kernels"] == ["fused per tensor kind"]
    # During each step: the DTensors (the first Linear) and the plain tensors as two fused groups.
    assert split["seen"] and all(s == [(2, True), (4, True)] for s in split["seen"]), split["seen"]
    # Between steps the user's one group, its schedule applied (4 halvings) and one group in the state dict.
    assert split["groups"] == split["saved_groups"] == 1 and split["lr"] == loop["lr"] == 1e-2 / 16
    for a, b in zip(split["params"], loop["params"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def _adafactor_run(kwargs: dict) -> str | None:
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_llmpar import LLMParallelStrategy
    from lightning_llmpar.models import GPTModule

    torch.set_num_threads(1)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    module = GPTModule(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    module.configure_optimizers = lambda: torch.optim.Adafactor(module.parameters(), lr=1e-2)  # type: ignore[method-assign]
    trainer = Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, strategy=LLMParallelStrategy(**kwargs))
    try:
        trainer.fit(module, DataLoader(TensorDataset(ids, ids), batch_size=4))
    except ValueError as error:
        return str(error)
    return None


def test_adafactor_on_sharded_parameters_is_refused_before_the_first_step() -> None:
    # torch.optim.Adafactor's step fails on DTensors (an in-place op on a norm's partial placement) with torch's
    # message; parameters kept whole (pipeline, data parallelism without sharding) step as one process's.
    from tests.distributed import run_ranks

    for kwargs in ({"zero_stage": 3}, {"tensor_parallel": 2}):
        errors = run_ranks(_adafactor_run, 2, kwargs)
        assert all("Adafactor cannot step sharded parameters" in (e or "") and "zero_stage=0" in e for e in errors), errors
    for kwargs in ({"pipeline_parallel": 2, "pipeline_schedule": "1F1B"}, {"zero_stage": 0}):
        assert run_ranks(_adafactor_run, 2, kwargs) == [None, None], kwargs
