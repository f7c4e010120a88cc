"""DeepSpeed as the data-parallel sharding backend: one config built from the strategy's options,
merged with a user's DeepSpeed config, contradictions refused before any process does work."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

__all__ = ["build_deepspeed_config", "check_deepspeed_layout", "check_nvme", "deepspeed_precision", "DS_COMPRESSION"]

# DeepSpeed's compressed-communication optimizers, by the name `gradient_compression` takes.
DS_COMPRESSION = {"onebit_adam": "OneBitAdam", "zero_one_adam": "ZeroOneAdam"}


def _load(user_config: str | dict[str, Any] | None) -> dict[str, Any]:
    if user_config is None:
        return {}
    if isinstance(user_config, dict):
        return copy.deepcopy(user_config)
    path = Path(user_config)
    if not path.is_file():
        raise ValueError(f"deepspeed_config={user_config!r} is neither a dict nor an existing JSON file.")
    return json.loads(path.read_text())


def _offload(target: str | None, what: str) -> dict[str, Any] | None:
    if target is None:
        return None
    if target == "cpu":
        return {"device": "cpu", "pin_memory": False}
    return {"device": "nvme", "nvme_path": str(target), "pin_memory": False}


def _agree(user: dict[str, Any], key: str, ours: Any, what: str, fix: str) -> None:
    if key in user and user[key] != ours:
        raise ValueError(
            f"The DeepSpeed config sets {what} = {user[key]!r} but the strategy asks for {ours!r}. {fix}"
        )


def _refuse_loop_sections(user: dict[str, Any], gradient_compression: str | None) -> None:
    """Sections for what Lightning's loop owns here (schedule, optimizer, batch size, accumulation). The engine
    would run them beside the loop: a config's scheduler steps the learning rate of configure_optimizers'
    optimizer (WarmupLR: no update in two steps, then 0.03 for 0.1), and its optimizer is ignored for the one
    configure_optimizers returns."""
    if "scheduler" in user:
        raise ValueError(
            f"The DeepSpeed config has a scheduler section ({user['scheduler'].get('type')!r}); the learning-rate"
            " schedule comes from configure_optimizers (a torch LR scheduler that Lightning steps). Remove the"
            " 'scheduler' section and return the scheduler from configure_optimizers."
        )
    if "optimizer" in user and gradient_compression is None:
        raise ValueError(
            f"The DeepSpeed config has an optimizer section ({user['optimizer'].get('type')!r}); the optimizer is"
            " the one configure_optimizers returns (DeepSpeed's 1-bit Adam: gradient_compression='onebit_adam')."
            " Remove the 'optimizer' section."
        )
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        if key in user:
            raise ValueError(
                f"The DeepSpeed config sets {key} = {user[key]!r}; the batch size is the DataLoader's and"
                f" accumulation the Trainer's (accumulate_grad_batches). Remove {key!r} from the config."
            )
    if "gradient_accumulation_steps" in user and user["gradient_accumulation_steps"] != 1:
        raise ValueError(
            "The DeepSpeed config sets gradient_accumulation_steps; use Trainer(accumulate_grad_batches=...) instead."
        )


def deepspeed_precision(plugin: Any) -> dict[str, Any]:
    """The engine's own precision sections for one of our precision plugins (the engine then scales, casts and
    skips overflowed steps itself): FP16Precision -> fp16 with its dynamic loss scaler (same initial scale,
    growth interval and back-off), BF16Precision 'true' -> bf16 weights with fp32 masters, 'mixed' -> torch
    autocast in bf16. FP8 has no DeepSpeed equivalent."""
    from lightning_llmpar.precision.plugins import BF16Precision, FP8Precision, FP16Precision

    if plugin is None or type(plugin).__name__ == "Precision":
        return {}
    if type(plugin).__name__ == "DoublePrecision":  # the engine would train the fp32 module, silently
        raise ValueError(
            "precision='64-true' with sharding_backend='deepspeed': DeepSpeed's engine trains in fp32, fp16 or bf16,"
            " so the run would be fp32. Use sharding_backend='fsdp2' (the default) for float64, or precision='32-true'."
        )
    if isinstance(plugin, FP16Precision):
        from deepspeed.accelerator import get_accelerator

        if not get_accelerator().is_fp16_supported():
            raise ValueError(
                f"FP16Precision with sharding_backend='deepspeed' runs DeepSpeed's fp16 mode, which"
                f" {get_accelerator().device_name()} does not support here. Use BF16Precision, or the 'fsdp2' backend."
            )
        scaler = plugin.scaler
        return {"fp16": {"enabled": True, "initial_scale_power": int(math.log2(scaler.get_scale())),
                         "loss_scale_window": scaler.get_growth_interval(), "hysteresis": 1, "min_loss_scale": 1}}
    if isinstance(plugin, BF16Precision):
        if plugin.mode == "true":
            return {"bf16": {"enabled": True}}
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    if isinstance(plugin, FP8Precision):
        raise ValueError("FP8Precision has no DeepSpeed equivalent: use sharding_backend='fsdp2' (the default) for FP8.")
    raise ValueError(f"{type(plugin).__name__} has no DeepSpeed equivalent; use BF16Precision or FP16Precision.")


def build_deepspeed_config(
    *,
    zero_stage: int,
    user_config: str | dict[str, Any] | None = None,
    offload_optimizer: str | None = None,
    offload_parameters: str | None = None,
    gradient_clipping: float | None = None,
    gradient_compression: str | None = None,
    accumulate: int = 1,
    num_params: int | None = None,
    precision: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config for this run: the user's config plus ours, refusing any contradiction."""
    user = _load(user_config)
    config = copy.deepcopy(user)
    zero = dict(user.get("zero_optimization", {}))
    _agree(zero, "stage", zero_stage, "zero_optimization.stage", f"Set zero_stage={zero.get('stage')} or remove it from the config.")
    zero["stage"] = zero_stage
    for key, target in (("offload_optimizer", offload_optimizer), ("offload_param", offload_parameters)):
        wanted = _offload(target, key)
        if wanted is None:
            continue
        if key in zero and zero[key].get("device") not in (None, "none", wanted["device"]):
            raise ValueError(
                f"The DeepSpeed config offloads {key} to {zero[key].get('device')!r} but the strategy asks for"
                f" {wanted['device']!r}. Keep one of the two."
            )
        zero[key] = {**zero.get(key, {}), **wanted}
    for key, stage_needed in (("offload_optimizer", 1), ("offload_param", 3)):  # asked here or in the config
        device = (zero.get(key) or {}).get("device")
        if device not in (None, "none") and zero_stage < stage_needed:  # DeepSpeed would ignore it
            raise ValueError(
                f"Offloading {key.split('_')[1]} needs zero_stage >= {stage_needed} with DeepSpeed, got"
                f" zero_stage={zero_stage} (zero_optimization.{key}.device={device!r})."
            )
    if num_params is not None:
        # DeepSpeed's bucket defaults (5e8 elements, 2 GB in fp32) are sized for multi-billion models and
        # are allocated whole; never let a bucket exceed the model it holds. User settings win.
        bucket = int(min(5e8, max(1e6, num_params)))
        for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
            zero.setdefault(key, bucket)
    config["zero_optimization"] = zero
    for section in ("fp16", "bf16", "torch_autocast"):
        if user.get(section, {}).get("enabled"):
            raise ValueError(
                f"The DeepSpeed config enables {section}; precision comes from the Trainer (precision=... or"
                f" plugins=[BF16Precision()/FP16Precision()]). Remove the {section!r} section."
            )
    config.update(precision or {})
    _refuse_loop_sections(user, gradient_compression)
    if gradient_clipping is not None:
        _agree(user, "gradient_clipping", gradient_clipping, "gradient_clipping", "Use one value (Trainer gradient_clip_val).")
        config["gradient_clipping"] = gradient_clipping
    # DeepSpeed's own default clips at norm 1.0; a run without gradient_clip_val (or the config's) must not clip.
    config.setdefault("gradient_clipping", 0.0)
    if gradient_compression is not None:
        config["optimizer"] = {**user.get("optimizer", {}), "type": DS_COMPRESSION[gradient_compression]}
    # DeepSpeed requires a batch size; Lightning's DataLoader feeds the engine, so it reaches only DeepSpeed's logs.
    config["train_micro_batch_size_per_gpu"] = 1
    # Lightning's accumulate_grad_batches, so DeepSpeed knows where the accumulation boundary is.
    config["gradient_accumulation_steps"] = accumulate
    # A torch optimizer from configure_optimizers drives the sharded step; DeepSpeed's fused/CPU Adam
    # would need a compiler at run time.
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config.setdefault("steps_per_print", 10**9)
    return config


def check_nvme(*targets: str | None) -> None:
    """An offload target is 'cpu' or an NVMe folder, given as a path ('gpu' or 'nvme' read as a folder name put
    swap files under the working directory); NVMe needs DeepSpeed's async_io op, built only where libaio is."""
    if all(t in (None, "cpu") for t in targets):
        return
    for target in targets:
        if target not in (None, "cpu") and not ("/" in str(target) or Path(target).is_dir()):
            raise ValueError(
                f"Offload target {target!r} is neither 'cpu' nor a path to an NVMe folder: DeepSpeed offloads to host"
                " memory ('cpu') or to swap files in a folder. Give 'cpu', or the folder as a path ('/local_nvme',"
                " './nvme')."
            )
    import deepspeed.ops

    if not deepspeed.ops.__compatible_ops__.get("async_io", False):
        raise ValueError(
            f"Offloading to an NVMe directory ({[t for t in targets if t not in (None, 'cpu')]}) needs DeepSpeed's"
            " async_io op, which cannot be built on this machine (libaio is missing: install libaio-dev)."
            " Use offload_optimizer='cpu' / offload_parameters='cpu' instead."
        )


def check_deepspeed_layout(tp: int, pp: int, cpu_offload: bool, gradient_compression: str | None) -> None:
    if tp > 1 or pp > 1:
        raise ValueError(
            f"sharding_backend='deepspeed' runs the data-parallel axis only; tensor_parallel={tp} and"
            f" pipeline_parallel={pp} need sharding_backend='fsdp2' (the default)."
        )
    if cpu_offload:
        raise ValueError(
            "With sharding_backend='deepspeed' use offload_optimizer='cpu' (and offload_parameters='cpu' at"
            " zero_stage=3) instead of cpu_offload=True."
        )
    if gradient_compression is not None:
        if gradient_compression not in DS_COMPRESSION:
            raise ValueError(
                f"gradient_compression={gradient_compression!r} is not available with sharding_backend='deepspeed';"
                f" choose one of {sorted(DS_COMPRESSION)}."
            )
        import deepspeed

        try:
            import deepspeed.runtime.fp16.onebit  # noqa: F401
        except ImportError as err:
            raise ValueError(
                f"gradient_compression={gradient_compression!r} needs DeepSpeed's 1-bit optimizers, which"
                f" DeepSpeed {deepspeed.__version__} no longer ships. Install a DeepSpeed version that has"
                " deepspeed.runtime.fp16.onebit, or train without gradient_compression."
            ) from err
