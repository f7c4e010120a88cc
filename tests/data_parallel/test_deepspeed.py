"""sharding_backend='deepspeed': ZeRO 1/2/3 and CPU offload against one process, config merging, save/resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")

from lightning_llmpar import LLMParallelStrategy, export_consolidated  # noqa: E402
from lightning_llmpar.data_parallel.deepspeed_config import build_deepspeed_config  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.test_parity import GLOBAL_BATCH, assert_parity, reference_for  # noqa: E402
from tests.workloads import fit, fit_error, make_gpt  # noqa: E402

DS = {"sharding_backend": "deepspeed"}


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"zero_stage": 1}, id="zero1"),
        pytest.param({"zero_stage": 2}, id="zero2"),
        pytest.param({"zero_stage": 3}, id="zero3"),
        pytest.param({"zero_stage": 2, "offload_optimizer": "cpu"}, id="zero2-offload-optimizer"),
        pytest.param({"zero_stage": 3, "offload_optimizer": "cpu", "offload_parameters": "cpu"}, id="zero3-offload-all"),
    ],
)
def test_deepspeed_zero_matches_single_process(kwargs: dict[str, Any]) -> None:
    outs = run_ranks(fit, 2, "gpt", {**DS, **kwargs}, batch_size=GLOBAL_BATCH // 2)
    assert_parity(reference_for("gpt"), outs, 2)


def test_deepspeed_accumulation_and_clipping() -> None:
    ref = reference_for("gpt", accumulate=2, clip=0.1, sgd=True)
    outs = run_ranks(fit, 2, "gpt", {**DS, "zero_stage": 2}, batch_size=GLOBAL_BATCH // 2, accumulate=2, clip=0.1, sgd=True)
    assert_parity(ref, outs, 2)


@pytest.mark.parametrize("kwargs", [pytest.param({"zero_stage": 0}, id="zero0"), pytest.param({"zero_stage": 1}, id="zero1"),
                                    pytest.param({"zero_stage": 3, "offload_optimizer": "cpu"}, id="zero3-offload")])
def test_deepspeed_steps_where_lightning_ends_an_accumulation_group(kwargs: dict[str, Any]) -> None:
    # Five batches an epoch, groups of two: Lightning steps on the epoch's last batch alone. DeepSpeed counted its
    # own micro-steps and put the boundary elsewhere: ZeRO-1/2 crashed in that step, ZeRO-0 left each rank with its
    # own gradient (the ranks' weights 0.03 apart), offloaded ZeRO-3 stepped on stale ones.
    run = dict(accumulate=2, clip=0.3, sgd=True, samples=GLOBAL_BATCH * 5, epochs=2, steps=-1)
    ref = reference_for("gpt", **run)
    assert_parity(ref, run_ranks(fit, 2, "gpt", {**DS, **kwargs}, batch_size=GLOBAL_BATCH // 2, **run), 2)


def test_deepspeed_does_not_clip_unless_asked() -> None:
    # DeepSpeed's own default is gradient_clipping=1.0: a run without gradient_clip_val clipped every step whose
    # gradient norm passed 1 (SGD makes the changed step size visible in the weights).
    ref = reference_for("gpt_steep", sgd=True)
    norm = torch.stack([g.norm() for g in ref["grads"].values()]).norm()
    assert norm > 1.0, f"the case needs a gradient norm above DeepSpeed's default clip, got {norm:.3f}"
    assert_parity(ref, run_ranks(fit, 2, "gpt_steep", {**DS, "zero_stage": 2}, batch_size=GLOBAL_BATCH // 2, sgd=True), 2)


def test_deepspeed_checkpoint_resumes_and_exports(tmp_path: Path) -> None:
    samples = 80  # 5 steps an epoch: save at the epoch boundary
    run = lambda world, kw, **k: run_ranks(fit, world, "gpt", kw, batch_size=GLOBAL_BATCH // world, samples=samples, **k)  # noqa: E731
    plain_path = tmp_path / "plain.ckpt"
    run(1, None, steps=-1, epochs=1, save_to=str(plain_path))
    plain = run(1, None, steps=10, ckpt_path=str(plain_path))[0]
    path = tmp_path / "ds.ckpt"
    first = run(2, {**DS, "zero_stage": 3}, steps=-1, epochs=1, save_to=str(path))
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    # DeepSpeed unpickles its files: refused unless trusted explicitly.
    refused = run_ranks(fit_error, 2, "gpt", {**DS, "zero_stage": 3}, batch_size=GLOBAL_BATCH // 2, steps=10,
                        ckpt_path=str(path))
    assert all("DeepSpeed reads it by unpickling" in e and "checkpoint_weights_only=False" in e for e in refused), refused
    resumed = run(2, {**DS, "zero_stage": 3, "checkpoint_weights_only": False}, steps=10, ckpt_path=str(path))
    for i in range(5):
        loss = sum(o["losses"][i] for o in resumed) / 2
        assert abs(loss - plain["losses"][i]) < 1e-5, (i, loss, plain["losses"][i])
    for name, param in plain["params"].items():
        torch.testing.assert_close(resumed[0]["params"][name], param, atol=5e-4, rtol=0)
    with pytest.raises(ValueError, match="weights_only=False"):
        export_consolidated(path, tmp_path / "model.pt")
    weights = torch.load(export_consolidated(path, tmp_path / "model.pt", weights_only=False), weights_only=True)
    module = make_gpt()
    module.load_state_dict(weights, strict=True)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.detach(), first[0]["params"][name], atol=0, rtol=0)


@pytest.mark.parametrize("zero", [0, 1])
def test_deepspeed_checkpoint_exports_every_parameter(tmp_path: Path, zero: int) -> None:
    # ZeRO-0 writes no optimizer partitions, which DeepSpeed's zero_to_fp32 needs (it failed with a TypeError); at
    # ZeRO-1 zero_to_fp32 leaves frozen parameters out (the export then failed load_state_dict, missing them).
    path = tmp_path / "ds.ckpt"
    out = run_ranks(fit, 2, "gpt_first_block_frozen", {**DS, "zero_stage": zero}, batch_size=GLOBAL_BATCH // 2, steps=2,
                    save_to=str(path))
    weights = torch.load(export_consolidated(path, tmp_path / "model.pt", weights_only=False), weights_only=True)
    module = make_gpt()
    module.load_state_dict(weights, strict=True)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.detach(), out[0]["params"][name], atol=0, rtol=0)


def test_user_config_is_merged() -> None:
    user = {"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 1000}, "wall_clock_breakdown": False}
    config = build_deepspeed_config(zero_stage=2, user_config=user, offload_optimizer="cpu", gradient_clipping=1.0, accumulate=4)
    assert config["zero_optimization"]["overlap_comm"] is True
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["gradient_clipping"] == 1.0 and config["gradient_accumulation_steps"] == 4
    assert config["wall_clock_breakdown"] is False
    # Buckets never exceed the model; the user's own bucket size wins.
    sized = build_deepspeed_config(zero_stage=3, num_params=25_000_000, user_config={"zero_optimization": {"reduce_bucket_size": 7}})
    assert sized["zero_optimization"]["allgather_bucket_size"] == 25_000_000
    assert sized["zero_optimization"]["stage3_prefetch_bucket_size"] == 25_000_000
    assert sized["zero_optimization"]["reduce_bucket_size"] == 7


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"zero_stage": 3, "deepspeed_config": {"zero_optimization": {"stage": 2}}},
         r"config sets zero_optimization.stage = 2 but the strategy asks for 3"),
        ({"zero_stage": 2, "offload_optimizer": "cpu",
          "deepspeed_config": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}},
         r"offloads offload_optimizer to 'nvme' but the strategy asks for 'cpu'"),
        ({"zero_stage": 2, "offload_parameters": "cpu"}, r"Offloading param needs zero_stage >= 3"),
        ({"zero_stage": 2, "deepspeed_config": {"zero_optimization": {"offload_param": {"device": "cpu"}}}},
         r"Offloading param needs zero_stage >= 3 with DeepSpeed, got zero_stage=2 \(zero_optimization\.offload_param\.device='cpu'\)"),
        ({"zero_stage": 2, "deepspeed_config": {"bf16": {"enabled": True}}}, r"enables bf16; precision comes from the Trainer"),
        ({"zero_stage": 2, "deepspeed_config": {"gradient_accumulation_steps": 4}}, r"use Trainer\(accumulate_grad_batches=...\)"),
        ({"zero_stage": 2, "deepspeed_config": "/no/such/file.json"}, r"neither a dict nor an existing JSON file"),
        # What Lightning's loop owns: a config scheduler took over configure_optimizers' learning rate (WarmupLR), a
        # config optimizer was ignored, and train_batch_size failed in DeepSpeed against a micro-batch it never had.
        ({"deepspeed_config": {"scheduler": {"type": "WarmupLR", "params": {}}}}, r"scheduler section \('WarmupLR'\)"),
        ({"deepspeed_config": {"optimizer": {"type": "AdamW"}}}, r"optimizer section \('AdamW'\); the optimizer is"),
        ({"deepspeed_config": {"train_batch_size": 2}}, r"train_batch_size = 2; the batch size is the DataLoader's"),
        ({"deepspeed_config": {"train_micro_batch_size_per_gpu": 2}}, r"Remove 'train_micro_batch_size_per_gpu'"),
        ({"tensor_parallel": 2}, r"tensor_parallel=2 and pipeline_parallel=1 need sharding_backend='fsdp2'"),
        ({"zero_stage": 3, "cpu_offload": True}, r"use offload_optimizer='cpu'"),
        # Read as an NVMe folder named 'gpu' under the working directory.
        ({"zero_stage": 2, "offload_optimizer": "gpu"}, r"Offload target 'gpu' is neither 'cpu' nor a path"),
        ({"gradient_compression": "topk"}, r"gradient_compression='topk' is not available with sharding_backend='deepspeed'"),
        # The DeepSpeed engine composes nothing of ours: the cut was silently not applied.
        ({"expert_capacity_factor": 0.5}, r"expert_capacity_factor=0.5 is applied .* it would be ignored"),
    ],
)
def test_contradictions_and_unsupported_layouts_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLMParallelStrategy(**DS, **kwargs)


def test_a_module_without_an_optimizer_is_refused_clearly() -> None:
    # Lightning trains it (no step); DeepSpeed's ZeRO optimizer failed on it with an IndexError.
    error = run_ranks(fit_error, 1, "gpt_without_optimizer", {**DS, "zero_stage": 2}, steps=1)[0]
    assert error is not None and error.startswith("ValueError: sharding_backend='deepspeed' needs an optimizer"), error


def test_options_of_the_other_backend_are_refused() -> None:
    with pytest.raises(ValueError, match=r"offload_optimizer apply to sharding_backend='deepspeed' only"):
        LLMParallelStrategy(zero_stage=2, offload_optimizer="cpu")
    with pytest.raises(ValueError, match=r"`sharding_backend` must be one of \('fsdp2', 'deepspeed'\)"):
        LLMParallelStrategy(sharding_backend="megatron")


def test_config_from_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 1, "allgather_bucket_size": 123}}')
    config = build_deepspeed_config(zero_stage=1, user_config=str(path))
    assert config["zero_optimization"] == {"stage": 1, "allgather_bucket_size": 123}
    strategy = LLMParallelStrategy(**DS, zero_stage=1, deepspeed_config=str(path))
    assert type(strategy) is LLMParallelStrategy and strategy.sharding_backend.name == "deepspeed"


def test_activation_checkpointing_recomputes_under_the_engine_and_changes_nothing_else() -> None:
    # The callback left the wrapping to the strategy, whose DeepSpeed backend composes nothing: no block was
    # checkpointed, without a word. It wraps the blocks itself now, before the engine takes the module.
    kw = {**DS, "zero_stage": 3}
    kept = run_ranks(fit, 2, "gpt", kw, batch_size=8, steps=3, checkpointing={"mode": "none", "measure": True})
    recomputed = run_ranks(fit, 2, "gpt", kw, batch_size=8, steps=3, checkpointing={"mode": "full", "measure": True})
    total = "activation_mb/total"
    assert recomputed[0]["logged"][total] < 0.5 * kept[0]["logged"][total], (recomputed[0]["logged"], kept[0]["logged"])
    for a, b in zip(kept, recomputed):
        assert a["losses"] == b["losses"]
        for name, param in a["params"].items():
            torch.testing.assert_close(b["params"][name], param, atol=0, rtol=0)


def test_pretrained_weights_are_loaded_under_the_engine(tmp_path: Path) -> None:
    # hf_checkpoint and litgpt_checkpoint are read by the strategy's composition, which the DeepSpeed engine
    # skips: the model trained from its random initialization without a word (losses 4.147 vs 4.161 at step 1).
    # A model built on the meta device could not start at all.
    from tests.zoo import fit_case, save_pretrained

    save_pretrained("llama", str(tmp_path))
    ref = run_ranks(fit_case, 1, "llama", None, 8, pretrained=str(tmp_path))[0]
    for zero, meta in ((1, False), (3, True)):
        outs = run_ranks(fit_case, 2, "llama", {**DS, "zero_stage": zero}, 4, pretrained=str(tmp_path), meta=meta)
        losses = [sum(o["losses"][i] for o in outs) / 2 for i in range(len(ref["losses"]))]
        assert losses == pytest.approx(ref["losses"], abs=1e-5, rel=0), (zero, losses, ref["losses"])
