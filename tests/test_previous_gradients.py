"""Lightning zeroes gradients after the training step, so the previous step's stay through its forward (and through
a pipeline's whole schedule, which runs backward inside the step). The strategy releases them before the step
where that zero_grad would discard them unread, and keeps them wherever something reads or keeps them."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from tests.distributed import run_ranks
from tests.workloads import fit, full

TOL = 1e-5


class PreviousGradients(Callback):
    """For each batch after the first: how many of the previous batch's gradient tensors this rank had at the
    batch's start, and how many of them were still alive when the step's first module forward ran."""

    def __init__(self) -> None:
        self.previous: list[int] = []
        self.alive: list[int] = []
        self._refs: list[weakref.ref] = []
        self._probed = True

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for module in pl_module.modules():
            module.register_forward_pre_hook(self._probe)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._refs = [weakref.ref(p.grad) for p in pl_module.parameters() if p.grad is not None]
        self._probed = False

    def _probe(self, module: Any, args: Any) -> None:
        if not self._probed and self._refs:
            self.previous.append(len(self._refs))
            self.alive.append(sum(ref() is not None for ref in self._refs))
        self._probed = True

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._refs = []


class ReadsGradientsBeforeZeroGrad(PreviousGradients):
    """A hook that reads the gradients Lightning is about to zero: the previous step's."""

    def __init__(self) -> None:
        super().__init__()
        self.before_zero_grad: list[float] = []
        self.at_step: list[float] = []

    @staticmethod
    def _square_sum(module: LightningModule) -> float:
        return sum(float(full(p.grad).double().pow(2).sum()) for p in module.parameters() if p.grad is not None)

    def on_before_zero_grad(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.before_zero_grad.append(self._square_sum(pl_module))

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.at_step.append(self._square_sum(pl_module))


class LeftOutGradient(Callback):
    """The gradient of the parameter the optimizer leaves out, at the end of training (on the rank holding it)."""

    def __init__(self) -> None:
        self.grad: list[float] = []

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        params = dict(pl_module.named_parameters())
        param = params.get(type(pl_module).LEFT_OUT)
        if param is not None and param.grad is not None:
            self.grad = full(param.grad).flatten().tolist()


LAYOUTS = [pytest.param({}, 1, id="one-process"), pytest.param({"zero_stage": 3}, 2, id="dp2-zero3"),
           pytest.param({"pipeline_parallel": 2}, 2, id="pp2")]


@pytest.mark.parametrize(("kwargs", "world"), LAYOUTS)
def test_released_before_the_step_where_zero_grad_follows_unread(kwargs: dict[str, Any], world: int) -> None:
    outs = run_ranks(fit, world, "gpt", kwargs, steps=3, sgd=True, callbacks_extra=[PreviousGradients()])
    for out in outs:
        probe = out["extra"][0]
        assert len(probe["previous"]) == 2 and all(n > 0 for n in probe["previous"]) and probe["alive"] == [0, 0], probe


@pytest.mark.parametrize(("kwargs", "world"), [pytest.param({"pipeline_parallel": 2}, 2, id="pp2"),
                                               pytest.param({"tensor_parallel": 2}, 2, id="tp2")])
def test_released_on_transformers_llama_with_tied_embeddings(kwargs: dict[str, Any], world: int) -> None:
    """A model nobody here wrote, its embedding tied to the head (a copy on the last stage under a pipeline):
    released as well, and what the user reads (each step's loss, the logged loss) is one process's."""
    pytest.importorskip("transformers")
    ref = run_ranks(fit, 1, "llama_tied", None, batch_size=8, steps=3, sgd=True)[0]
    outs = run_ranks(fit, world, "llama_tied", kwargs, batch_size=8, steps=3, sgd=True,
                     callbacks_extra=[PreviousGradients()])
    for out in outs:
        probe = out["extra"][0]
        assert len(probe["previous"]) == 2 and probe["alive"] == [0, 0], probe
        assert all(abs(a - b) < TOL for a, b in zip(out["losses"], ref["losses"], strict=True)), (out["losses"], ref["losses"])
        assert abs(out["logged"]["train_loss"] - ref["logged"]["train_loss"]) < TOL


@pytest.mark.parametrize(("kwargs", "world"), [LAYOUTS[0], LAYOUTS[2]])
def test_kept_for_a_hook_that_reads_them_before_zero_grad(kwargs: dict[str, Any], world: int) -> None:
    outs = run_ranks(fit, world, "gpt", kwargs, steps=3, sgd=True, callbacks_extra=[ReadsGradientsBeforeZeroGrad()])
    for out in outs:
        probe = out["extra"][0]
        assert len(probe["previous"]) == 2 and probe["alive"] == probe["previous"], probe
        # The hook sees the gradients the previous optimizer step used, as Lightning shows them.
        assert probe["before_zero_grad"][0] == 0.0 and probe["at_step"][0] > 0, probe
        assert probe["before_zero_grad"][1:] == probe["at_step"][:-1], probe


def test_kept_under_accumulation_over_batches() -> None:
    # The later batches of a window add to them; the first would release them to no lower peak.
    probe = run_ranks(fit, 1, "gpt", {}, steps=2, accumulate=2, sgd=True, callbacks_extra=[PreviousGradients()])[0]
    assert len(probe["extra"][0]["previous"]) == 3 and probe["extra"][0]["alive"] == probe["extra"][0]["previous"]


@pytest.mark.parametrize(("kwargs", "world"), [LAYOUTS[0], LAYOUTS[2]])
def test_a_parameter_the_optimizer_leaves_out_accumulates_as_under_lightning(kwargs: dict[str, Any], world: int) -> None:
    """zero_grad clears only the optimizer's parameters: another one's gradient adds up over the steps, as one
    plain Lightning process shows."""
    ref = run_ranks(fit, 1, "gpt_partly_optimized", None, batch_size=16, steps=4, callbacks_extra=[LeftOutGradient()])[0]
    dp = world // kwargs.get("pipeline_parallel", 1)
    outs = run_ranks(fit, world, "gpt_partly_optimized", kwargs, batch_size=16 // dp, steps=4,
                     callbacks_extra=[LeftOutGradient()])
    for i, loss in enumerate(ref["losses"]):
        assert abs(sum(o["losses"][i] for o in outs) / len(outs) - loss) < TOL, (i, [o["losses"] for o in outs])
    expected = torch.tensor(ref["extra"][0]["grad"])
    grads = [torch.tensor(o["extra"][0]["grad"]) for o in outs if o["extra"][0]["grad"]]
    assert grads and expected.abs().sum() > 0
    for grad in grads:
        torch.testing.assert_close(grad, expected, atol=TOL, rtol=0)
