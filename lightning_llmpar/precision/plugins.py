"""Precision plugins that know the device mesh: BF16 (mixed / true), FP16 with mesh-wide loss scaling, FP8.

Pass them as ``Trainer(plugins=[...])`` (Lightning's ``precision=`` accepts only its own strings, and turns
``"16-mixed"`` into bf16 on CPU). ``LLMParallelStrategy`` reads three things from a plugin:

- ``mp_policy()``: the FSDP2 ``MixedPrecisionPolicy`` for sharded layouts (parameters cast per unit at
  all-gather, gradients reduced in ``reduce_dtype``, sharded master weights and optimizer state in fp32);
- ``needs_sharding_wrapper``: the policy is the only thing that makes the compute dtype differ from the
  parameters' (BF16 true with fp32 masters), so the strategy applies FSDP2 even with one data-parallel rank;
- ``convert_before_parallelism(module)``: module swaps (FP8 linears) that must happen before tensor
  parallelism and sharding see the modules.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lightning_llmpar.precision.fp8 import skip_patterns

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["BF16Precision", "FP8Precision", "FP16Precision", "MeshGradScaler", "compute_dtype", "mesh_precision"]


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class MeshGradScaler(torch.amp.GradScaler):
    """A GradScaler whose overflow decision is taken by every process together.

    Each rank holds only its shards (tensor-parallel slices, ZeRO shards, its pipeline stage), so an inf
    on one rank is invisible to the others: with a per-rank decision some ranks would step and others
    skip, and the replicas would silently diverge. The local found-inf flag is all-reduced (MAX) over
    the whole world - every rank of every mesh axis - before the step and the scale update read it.
    """

    def _unscale_grads_(  # type: ignore[override]
        self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                # DTensor gradients: unscale this rank's shard in place (the flag is agreed below).
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                if not allow_fp16 and local.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients: keep parameters in fp32 with FP16Precision.")
                by_dtype.setdefault(local.dtype, []).append(local)
        with torch.no_grad():
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return {found_inf.device: found_inf}


class _MeshPrecision:
    """What LLMParallelStrategy asks of a precision plugin (defaults: nothing to do)."""

    needs_sharding_wrapper = False
    compute_dtype: torch.dtype = torch.float32

    def mp_policy(self) -> MixedPrecisionPolicy | None:
        return None

    def convert_before_parallelism(self, module: nn.Module) -> None:
        return None

    def scale_loss(self, loss: Tensor) -> Tensor:
        """Applied to each pipeline microbatch loss, where the strategy's own backward is not used."""
        return loss

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Lightning's own strategies (one device, DDP) convert here, where LLMParallelStrategy uses
        ``convert_before_parallelism`` and ``mp_policy``: without this, a one-process reference run with the plugin
        (``strategy="auto"``) silently trained in fp32."""
        if self.needs_sharding_wrapper:
            raise ValueError(
                f"{type(self).__name__}(mode='true') casts the fp32 master weights to bf16 through"
                " LLMParallelStrategy's FSDP2 units; under another strategy it would train in fp32. Use"
                " Trainer(strategy=LLMParallelStrategy(), ...) (one device too), or Lightning's precision='bf16-true'"
                " (bf16 weights, no fp32 master)."
            )
        self.convert_before_parallelism(module)
        return module


class BF16Precision(_MeshPrecision, MixedPrecision):
    """BF16 compute with fp32 master weights and optimizer state.

    Args:
        mode: 'mixed' - autocast (matmuls in bf16, reductions/softmax in fp32) and, where sharded, FSDP2
            gathers parameters in bf16; 'true' - every op in bf16 (no autocast): FSDP2 casts the fp32 master
            parameters to bf16 per unit, applied even with one data-parallel rank.
        reduce_dtype: dtype of gradient reduction across data-parallel ranks. fp32 by default: sums of many
            bf16 gradients lose bits, and gloo cannot reduce bf16 at all.
        device: autocast device type ('auto': cuda when available, else cpu).
    """

    def __init__(
        self, mode: Literal["mixed", "true"] = "mixed", reduce_dtype: str = "float32", device: str = "auto"
    ) -> None:
        if mode not in ("mixed", "true"):
            raise ValueError(f"BF16Precision(mode={mode!r}): mode must be 'mixed' or 'true'.")
        super().__init__("bf16-mixed", _default_device() if device == "auto" else device)
        # What Lightning reads as the run's precision (trainer.precision, the model summary's bytes per parameter).
        self.precision = "bf16-true" if mode == "true" else "bf16-mixed"
        self.mode = mode
        self.reduce_dtype = _dtype("reduce_dtype", reduce_dtype)
        self.needs_sharding_wrapper = mode == "true"
        self.compute_dtype = torch.bfloat16

    def mp_policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=self.reduce_dtype)

    def autocast_context_manager(self) -> torch.autocast:
        # Lightning's picks fp16 for any precision string but "bf16-mixed".
        return torch.autocast(self.device, dtype=torch.bfloat16, cache_enabled=False)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.autocast_context_manager() if self.mode == "mixed" else nullcontext():
            yield


class FP16Precision(_MeshPrecision, MixedPrecision):
    """FP16 autocast with dynamic loss scaling agreed by every rank (see :class:`MeshGradScaler`).

    Works on CPU too (Lightning's ``precision="16-mixed"`` silently becomes bf16 there). Sharded layouts
    gather parameters in fp16 and reduce gradients in fp32; master weights and optimizer state stay fp32.
    The scaler's state (scale, growth tracker) is saved in checkpoints.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device: str = "auto",
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(
                f"FP16Precision(init_scale={init_scale}, growth_factor={growth_factor}, backoff_factor="
                f"{backoff_factor}, growth_interval={growth_interval}): need init_scale > 0, growth_factor > 1,"
                " 0 < backoff_factor < 1 and growth_interval >= 1."
            )
        device = _default_device() if device == "auto" else device
        scaler = MeshGradScaler(
            device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )
        super().__init__("16-mixed", device, scaler=scaler)
        self.compute_dtype = torch.float16

    def mp_policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)

    def scale_loss(self, loss: Tensor) -> Tensor:
        assert self.scaler is not None
        return self.scaler.scale(loss)


Recipe = Literal["tensorwise", "rowwise"]


class FP8Precision(_MeshPrecision, Precision):
    """FP8 matmuls through torchao float8 training, converted before tensor parallelism and sharding.

    Args:
        recipe: 'tensorwise' (one scale per tensor; allows float8 all-gather with FSDP2) or 'rowwise'.
        base: precision of everything that is not an FP8 matmul: 'bf16-mixed' (autocast) or '32-true'.
        float8_all_gather: tensorwise only: FSDP2 gathers FP8 weights (half the bytes of bf16); the
            scales are then precomputed in one all-reduce after each optimizer step. Default: on for
            'tensorwise', off for 'rowwise'.
        keep_first_last: keep the first and last block of the stack, and every linear outside it (the
            LM head), in ``base`` precision: the layers most sensitive to FP8 rounding.
        skip: further module-name substrings to keep in ``base`` precision.

    Linears whose dimensions are not multiples of 16 (what FP8 matmul kernels need) are always kept.
    """

    def __init__(
        self,
        recipe: Recipe = "tensorwise",
        base: Literal["bf16-mixed", "32-true"] = "bf16-mixed",
        float8_all_gather: bool | None = None,
        keep_first_last: bool = True,
        skip: str | list[str] | None = None,
    ) -> None:
        if recipe not in get_args(Recipe):
            raise ValueError(f"FP8Precision(recipe={recipe!r}): recipe must be one of {get_args(Recipe)}.")
        if base not in ("bf16-mixed", "32-true"):
            raise ValueError(f"FP8Precision(base={base!r}): base must be 'bf16-mixed' or '32-true'.")
        if float8_all_gather is None:
            float8_all_gather = recipe == "tensorwise"
        if float8_all_gather and recipe != "tensorwise":
            raise ValueError(
                f"FP8Precision: float8_all_gather=True needs recipe='tensorwise' (got {recipe!r}); set"
                " float8_all_gather=False for rowwise scaling."
            )
        self.recipe, self.base, self.float8_all_gather = recipe, base, float8_all_gather
        self.keep_first_last, self.skip = keep_first_last, skip_patterns(skip)
        self.converted: list[str] = []
        self.compute_dtype = torch.float8_e4m3fn
        self._device = _default_device()

    def mp_policy(self) -> MixedPrecisionPolicy | None:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.base == "bf16-mixed" else None

    def convert_before_parallelism(self, module: nn.Module) -> None:
        from lightning_llmpar.precision.fp8 import convert_to_fp8

        self.converted = convert_to_fp8(
            module, self.recipe, float8_all_gather=self.float8_all_gather, keep_first_last=self.keep_first_last,
            skip=self.skip,
        )

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.base == "bf16-mixed":
            with torch.autocast(self._device, dtype=torch.bfloat16, cache_enabled=False):
                yield
        else:
            yield

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        out = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self.refresh_weight_scales(model)  # the next all-gather sends the updated weights
        return out

    def refresh_weight_scales(self, model: nn.Module) -> None:
        """With ``float8_all_gather``, FSDP gathers FP8 weights cast with scales precomputed from the whole weights
        (one all-reduce). Without them torchao takes each rank's amax over FSDP's ranks only, which under tensor
        parallelism is a shard's, not the weight's: 1.8e-4 off one process in the first loss at dp2 x tp2. So they
        are computed after every optimizer step, and by the strategy whenever weights are put in place (set-up,
        a checkpoint loaded)."""
        if self.float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)


def _dtype(name: str, value: str | torch.dtype) -> torch.dtype:
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}={value!r}: use 'float32', 'bfloat16' or 'float16'.")
    return dtype


def compute_dtype(plugin: Precision) -> torch.dtype:
    """The dtype the matmuls run in, for throughput/MFU (FP8 plugins report float8)."""
    dtype = getattr(plugin, "compute_dtype", None)
    if dtype is not None:
        return dtype
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

    return _plugin_to_compute_dtype(plugin)


def mesh_precision(plugin: Precision | None) -> Precision | None:
    """Lightning's own precision plugins (``precision="16-mixed"`` and friends) as their mesh-aware equivalents.

    Lightning's ``MixedPrecision("16-mixed")`` scales the loss of its own backward only (a pipeline schedule
    runs backward itself) and takes the overflow decision per rank (each sees only its shards); ``bf16-true``
    casts every weight with no fp32 master copy for sharded optimizers. Mapped: 16-mixed -> FP16Precision
    (scaler settings kept), bf16-mixed -> BF16Precision('mixed'), bf16-true -> BF16Precision('true').
    Plugins with no exact equivalent are refused.
    """
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision

    if plugin is None or isinstance(plugin, _MeshPrecision) or type(plugin) in (Precision, DoublePrecision):
        return plugin
    if isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed":
        scaler = plugin.scaler
        kwargs = {}
        if scaler is not None:
            kwargs = {"init_scale": scaler.get_scale(), "growth_factor": scaler.get_growth_factor(),
                      "backoff_factor": scaler.get_backoff_factor(), "growth_interval": scaler.get_growth_interval()}
        return FP16Precision(device=plugin.device, **kwargs)
    if isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed":
        return BF16Precision(mode="mixed", device=plugin.device)
    if isinstance(plugin, HalfPrecision) and plugin.precision == "bf16-true":
        return BF16Precision(mode="true")
    what = getattr(plugin, "precision", type(plugin).__name__)
    fix = (
        "16-true keeps fp16 weights with no loss scaling and no fp32 master copy; use precision='16-mixed' (or"
        " plugins=[FP16Precision()])" if what == "16-true" else
        "use precision='32-true', 'bf16-mixed', 'bf16-true' or '16-mixed', or the plugins BF16Precision,"
        " FP16Precision, FP8Precision"
    )
    raise ValueError(f"LLMParallelStrategy does not support the precision plugin {type(plugin).__name__}({what!r}): {fix}.")
