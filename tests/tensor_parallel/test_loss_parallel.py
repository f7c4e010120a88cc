"""Loss parallelism: the LM head's logits split over the vocabulary, the cross-entropy parallel, exact against one
process (fp32, SGD: losses every step and first-step gradients); other uses of the logits gathered or refused."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything
from torch.utils.data import TensorDataset

from lightning_llmpar.data import ordered_loader
from lightning_llmpar.models.gpt_module import GPTModule
from tests.distributed import run_ranks
from tests.zoo import Record, assert_exact, fit_cases

VOCAB, SEQ, SAMPLES, BATCH = 96, 16, 48, 4


class _GPT(GPTModule):
    """The example GPT with SGD and, per ``extra``, something more done with the logits in the step."""

    def __init__(self, extra: str = "") -> None:
        super().__init__(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
        self.extra = extra
        if extra == "logit_scale":  # a learnable temperature on the logits
            self.scale = torch.nn.Parameter(torch.tensor(1.3))
        if extra == "compiled":
            self.compiled_loss = torch.compile(_flat_cross_entropy, backend="aot_eager")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if self.extra in _OTHER_LOSSES:
            return _OTHER_LOSSES[self.extra](self, x, y)
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        if self.extra == "accuracy":  # a metric on the logits: argmax over the vocabulary
            self.log("train_acc", (logits.argmax(-1) == y).float().mean())
        elif self.extra == "z_loss":  # PaLM's z-loss: the log-partition of every position, squared
            loss = loss + 1e-2 * torch.logsumexp(logits, dim=-1).pow(2).mean()
        elif self.extra == "in_place":  # masking one token out of the vocabulary in place
            logits[..., 0] = -1e4
        elif self.extra == "tokens":  # per-token losses, returned with the logits
            per_token = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
            return {"loss": per_token.mean(), "logits": logits}
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _flat_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def _chunks_checkpointed(module: _GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # The cross-entropy chunk by chunk, each recomputed in the backward (reentrant: after the step has ended).
    from torch.utils.checkpoint import checkpoint

    def summed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")

    logits = module(x)
    total = sum(checkpoint(summed, logits[:, s:s + 4], y[:, s:s + 4], use_reentrant=True) for s in range(0, SEQ, 4))
    return total / y.numel()


def _fused_linear(module: _GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Liger/CCE-style: the final hidden states times the head's weight, without calling the head.
    model = module.model
    hidden, cos, sin = model.tok_emb(x), model.rope_cos[:SEQ], model.rope_sin[:SEQ]
    for layer in model.layers:
        hidden = layer(hidden, cos, sin)
    hidden = model.norm(hidden)
    return F.cross_entropy((hidden @ model.lm_head.weight.T).reshape(-1, VOCAB), y.reshape(-1))


_OTHER_LOSSES = {
    "logit_scale": lambda m, x, y: F.cross_entropy((m(x) * m.scale).reshape(-1, VOCAB), y.reshape(-1)),
    "checkpointed": _chunks_checkpointed,
    "compiled": lambda m, x, y: m.compiled_loss(m(x), y),
    "fused_linear": _fused_linear,
    "smoothed": lambda m, x, y: F.cross_entropy(m(x).reshape(-1, VOCAB), y.reshape(-1), label_smoothing=0.1),
}


class _Data(LightningDataModule):
    def __init__(self, data: TensorDataset) -> None:
        super().__init__()
        self.data = data

    def train_dataloader(self) -> Any:
        return ordered_loader(self.data, BATCH, self.trainer.strategy)


class _Seen(Callback):
    """What the step returned (its logits whole?) and what loss parallelism did."""

    def __init__(self) -> None:
        self.outputs: list[str] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if isinstance(outputs, dict) and "logits" in outputs:
            logits = outputs["logits"]
            self.outputs.append(f"{type(logits).__name__}{tuple(logits.shape)}")


def _fit_gpt(extra: str, strategy_kwargs: dict[str, Any] | None, steps: int = 6) -> dict[str, Any]:
    from lightning_llmpar import LLMParallelStrategy

    seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    record, seen = Record(), _Seen()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(
        accelerator="cpu", devices=1 if strategy_kwargs is None else world,
        strategy="auto" if strategy_kwargs is None else LLMParallelStrategy(**strategy_kwargs), max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[record, seen],
    )
    module = _GPT(extra)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=_Data(data))
    owner = getattr(trainer.strategy, "loss_parallel_heads", None)
    return {"losses": record.losses, "grads": record.grads, "held": 0.0, "outputs": seen.outputs,
            "split_steps": owner.split_steps if owner else 0, "local_bytes": owner.local_bytes if owner else 0,
            "gathered": sorted(owner.gathered_ops) if owner else [],
            "warnings": [str(w.message) for w in caught if "loss_parallel" in str(w.message)]}


def _gpt_cases(cases: list[tuple[str, dict[str, Any] | None]]) -> dict[tuple[str, str], Any]:
    import traceback

    env = dict(os.environ)
    out = {}
    for extra, kwargs in cases:
        os.environ.update(env)
        try:
            out[(extra, repr(kwargs))] = _fit_gpt(extra, kwargs)
        except Exception:  # noqa: BLE001 - each case reports its own error
            out[(extra, repr(kwargs))] = {"error": traceback.format_exc()}
    return out


TP2 = {"tensor_parallel": 2}
STRICT = {"tensor_parallel": 2, "loss_parallel": True}
OFF = {"tensor_parallel": 2, "loss_parallel": False}


def test_example_gpt_loss_parallel_exact_and_other_uses_of_the_logits() -> None:
    extras = ["", "accuracy", "z_loss", "tokens", "smoothed"]
    refs = run_ranks(_gpt_cases, 1, [(e, None) for e in extras])[0]
    cases = [("", STRICT), ("", OFF), ("accuracy", TP2), ("z_loss", TP2), ("tokens", STRICT), ("accuracy", STRICT),
             ("in_place", TP2), ("smoothed", TP2), ("smoothed", STRICT)]
    outs = run_ranks(_gpt_cases, 2, cases, timeout=600)
    get = [o[("", repr(STRICT))] for o in outs]
    # The plain cross-entropy: split, exact, and each rank held half of the logits (4 x 16 x 96 fp32 = 24 KiB whole).
    assert_exact(refs[("", "None")], get, sharded=False)
    assert [o["split_steps"] for o in get] == [6, 6] and all(o["local_bytes"] == BATCH * SEQ * VOCAB * 4 // 2 for o in get)
    assert all(not o["gathered"] and not o["warnings"] for o in get)
    off = [o[("", repr(OFF))] for o in outs]
    assert_exact(refs[("", "None")], off, sharded=False)
    assert all(o["split_steps"] == 0 for o in off)
    # Other ops on the logits ('auto'): gathered for them, exact, one warning naming the op.
    # (a cross-entropy with label smoothing too: the parallel one does not take it, which the message says)
    for extra, op, said in [("accuracy", "argmax", "argmax"), ("z_loss", "logsumexp", "logsumexp"),
                            ("smoothed", "cross_entropy", "with label_smoothing=0.1")]:
        runs = [o[(extra, repr(TP2))] for o in outs]
        assert_exact(refs[(extra, "None")], runs, sharded=False)
        assert all(any(op in g for g in o["gathered"]) for o in runs), [o["gathered"] for o in runs]
        assert len(runs[0]["warnings"]) == 1 and said in runs[0]["warnings"][0] and not runs[1]["warnings"]  # rank 0's
    # Per-token losses with the classes in dim 1 stay parallel; the logits the step returns come out whole.
    tokens = [o[("tokens", repr(STRICT))] for o in outs]
    assert_exact(refs[("tokens", "None")], tokens, sharded=False)
    assert all(o["outputs"][0] == f"Tensor({BATCH}, {SEQ}, {VOCAB})" for o in tokens), tokens[0]["outputs"]
    # loss_parallel=True refuses what would gather the logits, naming the op; an in-place change is refused always.
    for extra, kw, words in [("accuracy", STRICT, ["loss_parallel=True", "argmax", "loss_parallel='auto'"]),
                             ("in_place", TP2, ["in place", "__setitem__", "loss_parallel=False"]),
                             ("smoothed", STRICT, ["`cross_entropy`", "with label_smoothing=0.1 (which", "cross-entropy"
                                                   " on the logits in the training step without it"])]:
        errors = [o[(extra, repr(kw))].get("error", "") for o in outs]
        assert all(all(w in e for w in words) for e in errors), errors[0][-2000:]


def test_logit_scale_reentrant_checkpoint_and_compiled_loss_exact_on_split_logits() -> None:
    # A learnable scale times the split logits got a partial DTensor as its gradient (SGD failed on it); a reentrant
    # checkpoint reran the cross-entropy after the step, unwatched (mixed DTensor and tensor); dynamo traced the
    # parallel cross-entropy of a compiled loss function without torch's loss_parallel handlers.
    extras = ["logit_scale", "checkpointed", "compiled"]
    refs = run_ranks(_gpt_cases, 1, [(e, None) for e in extras])[0]
    cases = [("logit_scale", TP2), ("logit_scale", STRICT), ("checkpointed", STRICT), ("compiled", STRICT)]
    outs = run_ranks(_gpt_cases, 2, cases, timeout=600)
    for extra, kwargs in cases:
        runs = [o[(extra, repr(kwargs))] for o in outs]
        assert_exact(refs[(extra, "None")], runs, sharded=False)
        assert all(o["split_steps"] == 6 and not o["gathered"] and not o["warnings"] for o in runs), extra
    assert "scale" in refs[("logit_scale", "None")]["grads"]


def test_a_split_weight_read_by_the_step_is_explained_and_a_whole_head_is_exact() -> None:
    # `hidden @ lm_head.weight.T` (a fused linear cross-entropy) mixed the split weight with a plain tensor and
    # failed inside DTensor naming only `aten.mm`; with the head kept whole by tp_plan it is exact.
    whole = {"tensor_parallel": 2, "tp_plan": {"model.lm_head": "replicate"}}
    misspelt = {"tensor_parallel": 2, "tp_plan": {"model.lm_haed": "replicate"}}  # would have split the head
    ref = run_ranks(_gpt_cases, 1, [("fused_linear", None)])[0][("fused_linear", "None")]
    outs = run_ranks(_gpt_cases, 2, [("fused_linear", OFF), ("fused_linear", whole), ("fused_linear", misspelt)],
                     timeout=600)
    assert all("ValueError: tp_plan pattern 'model.lm_haed' matches no module of _GPT" in o[("fused_linear",
               repr(misspelt))]["error"] and "'model.lm_head'" in o[("fused_linear", repr(misspelt))]["error"]
               for o in outs), outs[0][("fused_linear", repr(misspelt))]
    errors = [o[("fused_linear", repr(OFF))].get("error", "") for o in outs]
    words = ["ValueError: tensor_parallel=2", "aten.mm", "lm_head.weight.T", "lm_head(hidden)", "'replicate'"]
    assert all(all(w in e for w in words) for e in errors), errors[0][-2000:]
    assert_exact(ref, [o[("fused_linear", repr(whole))] for o in outs], sharded=False)


# GPT-2: 65 tokens over 2 ranks; Gemma: embedding tied to the head; Mixtral with its router's auxiliary loss, which
# transformers adds to the cross-entropy in place (a view of the split loss's result could not be changed so).
ZOO = ["llama", "gpt2", "gemma_mqa", "mixtral_aux"]


def test_zoo_families_exact_with_loss_parallel_at_tp2() -> None:
    refs = run_ranks(fit_cases, 1, [(m, None, 8) for m in ZOO], timeout=600)[0]
    outs = run_ranks(fit_cases, 2, [(m, STRICT, 8) for m in ZOO], timeout=900)
    for m in ZOO:
        assert_exact(refs[(m, "None")], [o[(m, repr(STRICT))] for o in outs])


def test_loss_parallel_option_is_checked() -> None:
    from lightning_llmpar import LLMParallelStrategy

    with pytest.raises(ValueError, match="loss_parallel=True splits .* tensor_parallel=1"):
        LLMParallelStrategy(loss_parallel=True)
    with pytest.raises(ValueError, match="must be True, False or 'auto', got 'yes'"):
        LLMParallelStrategy(tensor_parallel=2, loss_parallel="yes")


FOUR = {"tp2-pp2": {"tensor_parallel": 2, "pipeline_parallel": 2, "loss_parallel": True},
        "dp2-tp2-zero3": {"tensor_parallel": 2, "zero_stage": 3, "loss_parallel": True},
        "cp2-tp2": {"tensor_parallel": 2, "context_parallel": 2, "loss_parallel": True}}


def test_loss_parallel_with_pipeline_zero_and_context_parallelism() -> None:
    cases = [("llama_tied", FOUR["tp2-pp2"], 8), ("llama", FOUR["dp2-tp2-zero3"], 4), ("llama", FOUR["cp2-tp2"], 8)]
    refs = run_ranks(fit_cases, 1, [("llama", None, 8), ("llama_tied", None, 8)], timeout=600)[0]
    outs = run_ranks(fit_cases, 4, cases, timeout=900)
    for name, kwargs, _ in cases:
        assert_exact(refs[(name, "None")], [o[(name, repr(kwargs))] for o in outs], sharded=False)


@pytest.mark.parametrize("loss_parallel", [True, False])
def test_token_ids_outside_the_vocabulary_are_refused_as_one_process_refuses_them(loss_parallel: bool) -> None:
    # Split by vocabulary, an id past its end falls in no rank's slice: tp2 trained on zero embeddings (and the
    # loss on targets no rank holds) where one process raises an IndexError.
    from tests.workloads import fit_error

    one = run_ranks(fit_error, 1, "gpt_vocab_48", None, batch_size=8, steps=1)[0]
    assert one is not None and one.startswith("IndexError"), one
    errors = run_ranks(fit_error, 2, "gpt_vocab_48", {"tensor_parallel": 2, "loss_parallel": loss_parallel},
                       batch_size=8, steps=1)
    assert all(e is not None and e.startswith("IndexError: Token ids [48,") for e in errors), errors


class _TargetsPastTheVocabulary(LightningDataModule):
    """Inputs inside a vocabulary of 48, targets up to 63."""

    def train_dataloader(self) -> Any:
        tokens = torch.randint(0, 64, (64, 17), generator=torch.Generator().manual_seed(0))
        return ordered_loader(TensorDataset(tokens[:, :-1] % 48, tokens[:, 1:]), 8, self.trainer.strategy)


def _fit_targets_past_the_vocabulary(kwargs: dict[str, Any] | None) -> str | None:
    from lightning_llmpar import LLMParallelStrategy
    from tests.workloads import GPT_ARGS

    trainer = Trainer(accelerator="cpu", devices=2 if kwargs else 1, max_steps=1, logger=False,
                      strategy=LLMParallelStrategy(**kwargs) if kwargs else "auto", enable_checkpointing=False,
                      enable_progress_bar=False, use_distributed_sampler=False)
    try:
        trainer.fit(GPTModule(**{**GPT_ARGS, "vocab_size": 48}), datamodule=_TargetsPastTheVocabulary())
    except IndexError as err:
        return str(err)
    return None


def test_targets_outside_the_vocabulary_are_refused_by_the_parallel_loss() -> None:
    # The vocabulary-parallel cross-entropy counted a target no rank holds as a zero logit and trained on.
    one = run_ranks(_fit_targets_past_the_vocabulary, 1, None)[0]
    assert one is not None and one.startswith("Target 53 is out of bounds"), one
    errors = run_ranks(_fit_targets_past_the_vocabulary, 2, {"tensor_parallel": 2, "loss_parallel": True})
    assert all(e is not None and e.startswith("Target 53 is out of bounds (the vocabulary has 48") for e in errors), errors



def _embed_scaled(in_place: bool) -> list[float]:
    """Gradients of the split embedding when the model scales its output (CTRL: ``inputs_embeds *= sqrt(d)``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_llmpar.tensor_parallel.styles import VocabEmbedding

    torch.manual_seed(0)
    emb = torch.nn.Embedding(VOCAB, 8)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    dist.init_process_group("gloo")
    parallelize_module(emb, init_device_mesh("cpu", (2,)), VocabEmbedding())
    out = emb(ids)
    if in_place:
        out *= 3.0
    else:
        out = out * 3.0
    out.pow(2).sum().backward()
    return emb.weight.grad.full_tensor().flatten().tolist()


def test_the_vocabulary_split_embedding_output_can_be_changed_in_place() -> None:
    # DTensor.to_local returns a view autograd forbids changing in place; the split embedding returns its own tensor,
    # whose in-place change differentiates as the same change out of place.
    apart = run_ranks(_embed_scaled, 2, False)
    for grads, ref in zip(run_ranks(_embed_scaled, 2, True), apart, strict=True):
        assert grads == ref
