"""What the ranks run in tests: tiny models, deterministic data, a fit that records losses and gradients."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.data import ordered_loader
from lightning_llmpar.models import GPTModule

VOCAB, SEQ = 64, 16


class TokenData(LightningDataModule):
    """Fixed random token windows; no shuffling, so DistributedSampler splits batches deterministically."""

    def __init__(self, batch_size: int, n: int = 256, seed: int = 1234, val_batch_size: int | None = None) -> None:
        super().__init__()
        self.val_batch_size = val_batch_size or batch_size
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
        self.data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        # Lightning's own sampler always shuffles training data; parity needs rank r of dp to take
        # samples r, r+dp, ... so that the dp ranks together see exactly the single-process batch.
        return ordered_loader(self.data, self.batch_size, self.trainer.strategy)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.val_batch_size, shuffle=False)


# The example GPT every exactness test trains: small enough for gloo on 2 cores, grouped key/value heads.
GPT_ARGS: dict[str, Any] = {"vocab_size": VOCAB, "block_size": SEQ, "n_layer": 4, "n_head": 4, "n_kv_head": 2,
                            "n_embd": 32, "learning_rate": 1e-2, "warmup_steps": 2, "total_steps": 20}


def make_gpt() -> LightningModule:
    return GPTModule(**GPT_ARGS)


class HFLlamaModule(LightningModule):
    """A transformers Llama built small from a config (random weights), as a user would wrap it."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                          tie_word_embeddings=tie, attn_implementation="sdpa")
        self.model = LlamaForCausalLM(cfg)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _HookedLlama(HFLlamaModule):
    """A transformers Llama with the user's own forward hooks, none of them linear: on the token embedding (split
    over the vocabulary: a partial sum before its reduction), on a row-split projection (sequence-sharded after
    its reduction under sequence parallelism) and on a column-split one."""

    def __init__(self) -> None:
        super().__init__()
        layer = self.model.model.layers[0].self_attn
        # Scaled by the output's size, as NEFTune scales its noise: a hook must see the whole sequence.
        self.model.model.embed_tokens.register_forward_hook(
            lambda _m, _i, out: out + F.gelu(out) * 4 / (out.size(1) * out.size(2)) ** 0.5)
        layer.o_proj.register_forward_hook(lambda _m, _i, out: torch.tanh(out) * out.size(1) / SEQ)
        layer.q_proj.register_forward_hook(lambda _m, _i, out: out * torch.sigmoid(out))


class _ExtraParameter(GPTModule):
    """The example GPT with one parameter more than its checkpoints have."""

    def __init__(self, strict: bool) -> None:
        super().__init__(**GPT_ARGS)
        self.extra = torch.nn.Parameter(torch.zeros(3))
        self.strict_loading = strict

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 0 * self.extra.sum()


class _PartlyOptimized(GPTModule):
    """The example GPT whose optimizer leaves out the final norm's weight: Lightning's zero_grad never clears that
    gradient, so it accumulates over the steps."""

    LEFT_OUT = "model.norm.weight"

    def __init__(self) -> None:
        super().__init__(**GPT_ARGS)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for n, p in self.named_parameters() if n != self.LEFT_OUT], lr=0.5)


class _SteepLoss(GPTModule):
    """The example GPT on four times its loss: gradient norms above 1 (DeepSpeed's default clipping threshold)."""

    def __init__(self) -> None:
        super().__init__(**GPT_ARGS)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return 4 * super().training_step(batch, batch_idx)


class _PositionsInForward(GPTModule):
    """The example GPT behind a LightningModule whose own forward takes ``position_ids`` too, as wrappers often do."""

    def __init__(self) -> None:
        super().__init__(**GPT_ARGS)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(idx, position_ids=position_ids)


class _Positioned(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(idx, position_ids=pos)


class _PositionsAtRoot(_PositionsInForward):
    """As above, but the model inside names its positions otherwise: only the LightningModule's forward takes them."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Positioned(self.model)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(idx, pos=position_ids)


def _without_optimizer() -> LightningModule:
    module = make_gpt()
    module.configure_optimizers = lambda: None  # type: ignore[method-assign]
    return module


def _first_block_frozen() -> LightningModule:
    module = make_gpt()
    module.model.layers[0].requires_grad_(False)
    return module


def _partly_frozen() -> LightningModule:
    """Frozen parameters beside trainable ones in the same blocks (so in the same FSDP units)."""
    module = make_gpt()
    module.model.layers[0].attn.q_proj.requires_grad_(False)
    module.model.layers[1].mlp_norm.requires_grad_(False)
    return module


class _ByHand(GPTModule):
    """The example GPT optimized by hand: ``optimizers`` SGDs over halves of its parameters, each stepping after its
    own backward, every ``every`` training steps."""

    def __init__(self, optimizers: int = 1, every: int = 1) -> None:
        super().__init__(**GPT_ARGS)
        self.automatic_optimization, self.parts, self.every = False, optimizers, every

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = self._unpack(batch)
        loss = self._loss(self(x), y)
        optimizers = self.optimizers() if self.parts > 1 else [self.optimizers()]
        for opt in optimizers:
            self.manual_backward(loss / self.parts, retain_graph=True)
            if (batch_idx + 1) % self.every == 0:
                opt.step()
                opt.zero_grad()
        return loss

    def configure_optimizers(self) -> Any:
        params = list(self.parameters())
        groups = [params[i :: self.parts] for i in range(self.parts)]
        return [torch.optim.SGD(g, lr=0.5) for g in groups] if self.parts > 1 else torch.optim.SGD(params, lr=0.5)


class _IgnoresToken0(GPTModule):
    """A loss ignoring token 0 (a pad token), not -100: the random windows hold it here and there."""

    def __init__(self) -> None:
        super().__init__(**GPT_ARGS)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=0)


MODELS = {"gpt": make_gpt, "llama": HFLlamaModule, "llama_tied": lambda: HFLlamaModule(tie=True), "llama_hooked": _HookedLlama,
          "gpt_extra": lambda: _ExtraParameter(True), "gpt_extra_lenient": lambda: _ExtraParameter(False),
          "gpt_partly_optimized": _PartlyOptimized, "gpt_steep": _SteepLoss, "gpt_positions_in_forward": _PositionsInForward,
          "gpt_positions_at_root": _PositionsAtRoot, "gpt_without_optimizer": _without_optimizer,
          "gpt_first_block_frozen": _first_block_frozen, "gpt_partly_frozen": _partly_frozen,
          "gpt_vocab_48": lambda: GPTModule(**{**GPT_ARGS, "vocab_size": 48}), "gpt_ignores_0": _IgnoresToken0,
          "gpt_two_optimizers_by_hand": lambda: _ByHand(optimizers=2), "gpt_accumulates_by_hand": lambda: _ByHand(every=2),
          "gpt_by_hand": _ByHand, "gpt_two_layers": lambda: GPTModule(**{**GPT_ARGS, "n_layer": 2})}  # the data's ids reach 63


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class Recorder(Callback):
    """Per-step loss, full gradients of the first step, and full parameters at the end."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: dict[str, torch.Tensor] = {}
        self.grad_norms: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.grads:
            return
        if getattr(trainer.strategy, "engine", None) is not None:
            # DeepSpeed keeps gradients in its own partitions, not in p.grad.
            from deepspeed.utils import safe_get_full_grad

            grads = {n: safe_get_full_grad(p) for n, p in pl_module.named_parameters()}
            self.grads = {n: g.detach().clone().cpu() for n, g in grads.items() if g is not None}
            return
        self.grads = {n: full(p.grad).cpu() for n, p in pl_module.named_parameters() if p.grad is not None}


def fit(
    model: str,
    strategy_kwargs: dict[str, Any] | None,
    *,
    steps: int = 10,
    batch_size: int = 8,
    accumulate: int = 1,
    clip: float | None = None,
    clip_algorithm: str = "norm",
    anomaly: bool = False,
    ckpt_path: str | None = None,
    save_to: str | None = None,
    sgd: bool = False,
    samples: int = 256,
    epochs: int | None = None,
    validate: bool = False,
    predict: bool = False,
    accelerator: str = "cpu",
    checkpointing: dict[str, Any] | None = None,
    precision: tuple[str, dict[str, Any]] | None = None,
    callbacks_extra: list[Callback] | None = None,
    val_batch_size: int | None = None,
    save_weights_only: bool = False,
    val_every: int | None = None,
) -> dict[str, Any]:
    """Train ``model`` for ``steps`` and report what a parity test compares.

    ``strategy_kwargs=None`` runs plain single-device Lightning: the reference.
    ``batch_size`` is per data-parallel rank.
    """
    seed_everything(0, verbose=False)
    module = MODELS[model]()
    if sgd:  # Adam cancels any per-tensor gradient scale; SGD makes a wrong clipping factor visible
        module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.5)  # type: ignore[method-assign]
    recorder = Recorder()
    callbacks: list[Callback] = [recorder]
    if checkpointing is not None:
        from lightning_llmpar.activation_checkpointing.policy import ActivationCheckpointing

        callbacks.append(ActivationCheckpointing(**checkpointing))
    callbacks.extend(callbacks_extra or [])
    plugins: list[Any] = []
    if precision is not None:
        from lightning_llmpar import precision as llmpar_precision

        plugins.append(getattr(llmpar_precision, precision[0])(**precision[1]))
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    strategy: Any = "auto" if strategy_kwargs is None else LLMParallelStrategy(**strategy_kwargs)
    trainer = Trainer(
        accelerator=accelerator,
        devices=1 if strategy_kwargs is None else world,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        gradient_clip_algorithm=clip_algorithm,
        detect_anomaly=anomaly,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=4 if validate or val_every else 0,
        val_check_interval=val_every,  # validation inside training: every ``val_every`` steps
        check_val_every_n_epoch=None if val_every else 1,
        callbacks=callbacks,
        max_epochs=epochs,
        use_distributed_sampler=False,
        plugins=plugins or None,
    )
    data = TokenData(batch_size, n=samples, val_batch_size=val_batch_size)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    val = trainer.validate(module, datamodule=data, verbose=False)[0] if validate else {}
    predictions = torch.cat(trainer.predict(module, dataloaders=data.val_dataloader())) if predict else None
    if save_to is not None:
        trainer.save_checkpoint(save_to, weights_only=save_weights_only)
    params = {n: full(p).cpu() for n, p in module.named_parameters()}
    if getattr(trainer.strategy, "engine", None) is not None and trainer.strategy.layout.zero_stage > 0:
        from deepspeed.utils import safe_get_full_fp32_param  # ZeRO-0 has no fp32 partitions: the module's own

        # (frozen parameters have no fp32 partition: below ZeRO-3 the module holds them whole)
        params = {n: (p if (f := safe_get_full_fp32_param(p)) is None else f).detach().clone().cpu()
                  for n, p in module.named_parameters()}
    local_shapes = {n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape) for n, p in module.named_parameters()}
    return {"losses": recorder.losses, "grads": recorder.grads, "params": params, "local_shapes": local_shapes,
            "logged": logged, "val": val, "predictions": predictions,
            "checkpointing_applied": any(getattr(c, "applied", False) for c in callbacks),
            "plugin": _plugin_report(trainer), "extra": [_plain(vars(c)) for c in callbacks_extra or []],
            "kernels": kernels(trainer)}


def fit_error(*args: Any, **kwargs: Any) -> str | None:
    """:func:`fit`'s error message, or None if it ran."""
    try:
        fit(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return None


def kernels(trainer: Trainer) -> set[str]:
    """Which optimizer kernels the parameter groups run ('fused', 'fused per tensor kind', 'loop', ...)."""
    from lightning_llmpar.training.optimizer import group_kernels

    return {kernel for opt in trainer.optimizers for kernel in group_kernels(opt)}


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if isinstance(v, (int, float, str, list))}


def _plugin_report(trainer: Trainer) -> dict[str, Any]:
    plugin = trainer.precision_plugin
    scaler = getattr(plugin, "scaler", None)
    weights = {type(_local(m.weight)).__name__ for m in trainer.lightning_module.modules() if type(m).__name__ == "Float8Linear"}
    return {"type": type(plugin).__name__, "scale": float(scaler.get_scale()) if scaler is not None else None,
            "converted": list(getattr(plugin, "converted", [])), "fp8_weight_types": sorted(weights)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class InjectInf(Callback):
    """Puts an inf into one gradient shard of one rank at one step: an overflow only that rank can see."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            _local(grad).view(-1)[0] = float("inf")


class StepRecorder(Callback):
    """Per step: the loss scale, and whether this rank's parameters changed (did the optimizer step)."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.updated: list[bool] = []
        self._before = 0.0

    def _checksum(self, module: LightningModule) -> float:
        return float(sum(_local(p.data).double().sum() for p in module.parameters()))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, idx: int) -> None:
        self._before = self._checksum(pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int) -> None:
        self.updated.append(self._checksum(pl_module) != self._before)
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))
