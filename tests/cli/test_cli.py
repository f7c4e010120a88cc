"""The `llmpar` command end to end: real LightningCLI, real launcher, real offline WandbLogger."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.checkpointing.dcp import is_checkpoint
from lightning_llmpar.cli import main
from tests.cli.test_quiet_run import assert_quiet

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
HAS_LITGPT = importlib.util.find_spec("litgpt") is not None
NEEDS_LITGPT = pytest.mark.skipif(not HAS_LITGPT, reason="litgpt is not installed (pip install --no-deps litgpt)")


def _train_from_single(tmp_path: Path, *overrides: str, output: list[str] | None = None) -> dict[str, str]:
    """Run `llmpar fit` on single.yaml with overrides; return its closing report lines by key (``output``: gets
    what the run printed)."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    args = ["fit", "--config", str(ROOT / "examples/configs/single.yaml"), "--trainer.devices", "2",
            "--trainer.limit_val_batches", "2", "--data.max_bytes", "300000", *overrides]
    result = subprocess.run([sys.executable, "-m", "lightning_llmpar.cli", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    if output is not None:
        output.append(result.stdout + result.stderr)
    return {line.split()[1]: line.split(maxsplit=2)[2] for line in result.stdout.splitlines() if line.startswith("llmpar: ")}


def _assert_logged(report: dict[str, str], keys: tuple[str, ...]) -> None:
    run_dir = Path(report["W&B"].split()[1])
    # The offline run file holds protobuf records; logged metric names appear in it verbatim.
    records = b"".join(p.read_bytes() for p in run_dir.glob("run-*.wandb"))
    for key in keys:
        assert key.encode() in records, f"{key} was not logged to the W&B run in {run_dir}"


def test_cli_override_to_compiled_tensor_parallel_trains_logs_and_checkpoints(tmp_path: Path) -> None:
    report = _train_from_single(
        tmp_path, "--trainer.strategy.tensor_parallel", "2", "--trainer.strategy.compile", "true",
        "--trainer.max_steps", "10", "--trainer.val_check_interval", "5", "--trainer.log_every_n_steps", "5",
    )
    assert "tp=2" in report["layout"] and "world_size=2" in report["layout"]
    assert is_checkpoint(Path(report["checkpoint"])), report["checkpoint"]
    _assert_logged(report, ("train/loss", "val/ppl", "val/loss", "perf/tokens_per_sec", "memory/rank0_mb",
                            "memory/rank1_mb"))


def test_cli_override_to_pipeline_parallel_draws_the_timeline(tmp_path: Path) -> None:
    printed: list[str] = []
    report = _train_from_single(
        tmp_path, "--trainer.strategy.pipeline_parallel", "2", "--trainer.max_steps", "6",
        "--trainer.val_check_interval", "3", "--trainer.log_every_n_steps", "3", output=printed,
    )
    # Two stages: rank 0 holds no loss, so its validation metric is never updated (torchmetrics warns per compute):
    # still no warning twice (test_quiet_run's checks).
    assert_quiet(printed[0])
    assert "pp=2" in report["layout"]
    picture = Path(report["timeline"])
    assert picture.is_file() and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert picture.parent == Path(report["checkpoint"]).parent
    actions = json.loads(picture.with_suffix(".json").read_text())
    assert {a[1] for rank in actions for a in rank["actions"]} == {"F", "B"}
    assert len(actions) == 2 and all(len(rank["actions"]) == 2 * 2 * 4 for rank in actions)  # 2 stages x 4 mb x F/B
    _assert_logged(report, ("train/loss", "val/ppl", "pipeline/bubble_fraction", "pipeline/timeline"))


def test_cli_mixture_of_experts_under_expert_parallel_logs_its_routing(tmp_path: Path) -> None:
    report = _train_from_single(
        tmp_path, "--trainer.strategy.expert_parallel", "2", "--model.n_expert", "4", "--trainer.max_steps", "4",
        "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "2",
    )
    assert "ep=2" in report["layout"]
    _assert_logged(report, ("train/aux_loss", "moe/expert_0_tokens", "moe/expert_3_tokens", "moe/imbalance",
                            "moe/dropped_tokens", "ep/bytes_sent", "val/ppl"))


@pytest.fixture(scope="module")
def tiny_pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's "pretrained" Hugging Face checkpoint, written offline as its header says."""
    out = tmp_path_factory.mktemp("hf") / "tiny-qwen3"
    subprocess.run([sys.executable, "-m", "lightning_llmpar.models.hf_causal_lm", str(ROOT / "examples/hf/tiny-qwen3"), str(out)],
                   check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def tiny_litgpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The LitGPT example's checkpoint, written offline as its header says."""
    if not HAS_LITGPT:
        pytest.skip("litgpt is not installed (pip install --no-deps litgpt)")
    out = tmp_path_factory.mktemp("litgpt") / "tiny-litgpt"
    subprocess.run([sys.executable, "-m", "lightning_llmpar.models.litgpt_module", str(ROOT / "examples/litgpt/tiny-llama"),
                    str(out)], check=True, capture_output=True, timeout=300)
    return out


@pytest.mark.parametrize("config", [pytest.param(c, marks=[NEEDS_LITGPT] if "litgpt" in c.stem else []) for c in CONFIGS],
                         ids=[c.stem for c in CONFIGS])
def test_example_configs_build_a_valid_trainer(
    config: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real parser instantiates model, data and Trainer; the strategy validates its layout
    # against the config's device count at Trainer construction.
    spec = yaml.safe_load(config.read_text())["trainer"]
    if spec["strategy"]["init_args"].get("fault_tolerance") == "torchft":  # one replica group's job, as documented
        monkeypatch.setenv("REPLICA_GROUP_ID", "0")
        monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    extra = []
    for key, fixture in (("hf_checkpoint", "tiny_pretrained"), ("litgpt_checkpoint", "tiny_litgpt")):
        if key in spec["strategy"]["init_args"]:
            extra = [f"--trainer.strategy.{key}", str(request.getfixturevalue(fixture))]
    cli = main(["--config", str(config), *extra], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, LLMParallelStrategy)
    assert strategy.layout.world_size == spec["devices"]
    degrees = spec["strategy"]["init_args"]
    assert strategy.layout.tp == degrees.get("tensor_parallel", 1)
    assert strategy.layout.zero_stage == degrees.get("zero_stage", 0)
    assert strategy.layout.cp == degrees.get("context_parallel", 1)
    assert strategy.layout.ep == degrees.get("expert_parallel", 1)
    for plugin in spec.get("plugins", []):
        assert type(cli.trainer.precision_plugin).__name__ == plugin["class_path"].rsplit(".", 1)[1]


def test_hugging_face_example_fine_tunes_and_exports(tmp_path: Path, tiny_pretrained: Path) -> None:
    # The documented workflow: pretrained weights read per rank at tp2 x pp2, fine-tuned, exported, and the
    # export loads in one process with transformers alone.
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "finetuned"
    args = ["fit", "--config", str(ROOT / "examples/configs/hf_qwen3.yaml"), "--trainer.strategy.hf_checkpoint",
            str(tiny_pretrained), "--trainer.callbacks.dirpath", str(out), "--model.model",
            str(ROOT / "examples/hf/tiny-qwen3"), "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
            "--trainer.limit_val_batches", "1", "--data.max_bytes", "200000"]
    result = subprocess.run([sys.executable, "-m", "lightning_llmpar.cli", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out / "final")  # the end-of-training export
    before = AutoModelForCausalLM.from_pretrained(tiny_pretrained)
    changed = [n for (n, a), (_, b) in zip(trained.named_parameters(), before.named_parameters()) if not torch.equal(a, b)]
    assert len(changed) == len(list(before.parameters())), "every weight was trained and exported"
    assert trained.lm_head.weight is trained.model.embed_tokens.weight  # still tied


@NEEDS_LITGPT
def test_litgpt_example_fine_tunes(tmp_path: Path, tiny_litgpt: Path) -> None:
    # The documented LitGPT workflow: its checkpoint read per rank at tp2 x ZeRO-3, fine-tuned with `llmpar fit`.
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    args = ["fit", "--config", str(ROOT / "examples/configs/litgpt.yaml"), "--trainer.strategy.litgpt_checkpoint",
            str(tiny_litgpt), "--model.model", str(ROOT / "examples/litgpt/tiny-llama"), "--trainer.max_steps", "3",
            "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1", "--data.max_bytes", "200000"]
    result = subprocess.run([sys.executable, "-m", "lightning_llmpar.cli", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = {line.split()[1]: line.split(maxsplit=2)[2] for line in result.stdout.splitlines() if line.startswith("llmpar: ")}
    _assert_logged(report, ("train/loss",))


def test_cli_runs_without_checkpointing_logger_or_progress_bar(tmp_path: Path) -> None:
    # What the command adds (a periodic checkpoint, a learning-rate monitor, a progress bar) steps aside when the
    # run turns the feature off.
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    args = ["fit", "--config", str(ROOT / "examples/configs/single.yaml"), "--trainer.max_steps", "2",
            "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2", "--data.max_bytes", "100000",
            "--trainer.enable_checkpointing=false", "--trainer.logger=false", "--trainer.enable_progress_bar=false"]
    result = subprocess.run([sys.executable, "-m", "lightning_llmpar.cli", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "llmpar: checkpoint  (none written)" in result.stdout


def test_progress_bar_counts_steps_of_a_step_bounded_run() -> None:
    from lightning.pytorch import Trainer

    from lightning_llmpar.cli.progress import StepRichProgressBar, StepTQDMProgressBar, step_progress_bar

    trainer = Trainer(max_steps=7, logger=False, enable_checkpointing=False, callbacks=[step_progress_bar()])
    bar = trainer.progress_bar_callback
    assert isinstance(bar, (StepRichProgressBar, StepTQDMProgressBar))
    bar._trainer = trainer
    trainer.fit_loop.max_batches = 1000  # an epoch far longer than the run
    assert bar.total_train_batches == 7
    rich = StepRichProgressBar()
    rich._trainer = trainer
    assert rich._get_train_description(0).strip() == "Epoch 0"  # not "Epoch 0/-2"


def _logged_losses(tmp_path: Path, name: str, *overrides: str) -> list[float]:
    """`llmpar fit` on single.yaml for 6 steps with a CSV log of every step; the example's train/loss, per step."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = tmp_path / name
    # One process's batches on every rank: dp is 1 in these layouts, and Lightning's sampler (which would draw its
    # own shuffle) is off, so each rank's loader shuffles with the seed one process has.
    args = ["fit", "--config", str(ROOT / "examples/configs/single.yaml"), "--trainer.max_steps", "6",
            "--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches", "0", "--data.max_bytes", "300000",
            "--trainer.use_distributed_sampler", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(out), *overrides]
    result = subprocess.run([sys.executable, "-m", "lightning_llmpar.cli", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    import csv

    rows = list(csv.DictReader((next(out.rglob("metrics.csv"))).open()))
    return [float(r["train/loss"]) for r in sorted(rows, key=lambda r: int(r["step"])) if r.get("train/loss")]


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _logged_losses(tmp_path_factory.mktemp("one"), "one")


@pytest.mark.parametrize("layout", [("--trainer.strategy.context_parallel", "2"),
                                    ("--trainer.strategy.pipeline_parallel", "2")], ids=["cp2", "pp2"])
def test_cli_logs_the_loss_one_process_logs(tmp_path: Path, layout: tuple[str, str], one_process_losses: list[float]) -> None:
    # The example logs self.log("train/loss", loss, prog_bar=True) without sync_dist: under context parallelism that
    # was rank 0's part of every sequence (3e-2 off); now what the CSV (and the bar) shows is one process's loss.
    one = one_process_losses
    two = _logged_losses(tmp_path, "two", "--trainer.devices", "2", *layout)
    assert len(one) == len(two) == 6, (one, two)
    for step, (a, b) in enumerate(zip(one, two)):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), f"step {step}: {b} logged at {layout[0]}, one process {a}"
