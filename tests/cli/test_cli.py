"""The `llmpar` command end to end: real LightningCLI, real launcher, real offline WandbLogger."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_llmpar import LLMParallelStrategy
from lightning_llmpar.checkpointing.dcp import is_checkpoint
from lightning_llmpar.cli import main
from tests.cli.test_quiet_run import assert_quiet
from tests.distributed import run_ranks

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
    assert is_checkpoint(Path(report["checkpoint"])), report["checkpoint"]
    picture = Path(report["timeline"])
    assert picture.is_file() and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert picture.parent == Path(report["checkpoint"]).parent
    actions = json.loads(picture.with_suffix(".json").read_text())
    assert {a[1] for rank in actions for a in rank["actions"]} == {"F", "B"}
    assert len(actions) == 2 and all(len(rank["actions"]) == 2 * 2 * 4 for rank in actions)  # 2 stages x 4 mb x F/B
    _assert_logged(report, ("train/loss", "val/ppl", "pipeline/bubble_fraction", "pipeline/timeline"))


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
    # Without a logger the config is saved into the current folder, which holds the user's own config.yaml here.
    mine = "# my notes\n" + (ROOT / "examples/configs/single.yaml").read_text()
    (tmp_path / "config.yaml").write_text(mine)
    args = ["fit", "--config", "config.yaml", "--trainer.max_steps", "2",
            "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2", "--data.max_bytes", "100000",
            "--trainer.enable_checkpointing=false", "--trainer.logger=false", "--trainer.enable_progress_bar=false"]
    result = subprocess.run([sys.executable, "-m", "lightning_llmpar.cli", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "llmpar: checkpoint  (none written)" in result.stdout
    assert (tmp_path / "config.yaml").read_text() == mine  # was replaced by the run's config
    saved = yaml.safe_load((tmp_path / "config-1.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 2 and f"llmpar: config      {tmp_path / 'config-1.yaml'}" in result.stdout


def test_progress_bar_counts_steps_of_a_step_bounded_run() -> None:
    from lightning.pytorch import Trainer

    from lightning_llmpar.cli.progress import StepRichProgressBar, StepTQDMProgressBar, step_progress_bar

    trainer = Trainer(max_steps=7, logger=False, enable_checkpointing=False, callbacks=[step_progress_bar()])
    bar = trainer.progress_bar_callback
    assert isinstance(bar, (StepRichProgressBar, StepTQDMProgressBar))
    bar._trainer = trainer
    trainer.fit_loop.max_batches = 1000  # an epoch far longer than the run
    assert bar.total_train_batches == 7
    # Resumed at batch 5 of the epoch with 2 steps left: the bar counts the epoch's batches (it read "5/2").
    trainer.fit_loop.epoch_loop.batch_progress.current.completed = 5
    trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = 5
    assert trainer.global_step == 5 and bar.total_train_batches == 7
    rich = StepRichProgressBar()
    rich._trainer = trainer
    assert rich._get_train_description(0).strip() == "Epoch 0"  # not "Epoch 0/-2"


def _last_step_saved(stop: str, folder: str) -> tuple[int, int]:
    """(global_step, epoch) of the command's default checkpoint's `last` when a run stops by ``stop``; a process of
    its own (launched by run_ranks): a run under LLMParallelStrategy leaves its process group and MASTER_PORT
    behind, which a later `llmpar fit` would inherit and fail to bind."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import EarlyStopping
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_llmpar.cli.main import _PeriodicCheckpoint

    class Model(BoringModel):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val", float(self.global_step))  # rising: early stopping stops at its second validation

    class Preempt(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            if trainer.global_step == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    checkpoint = _PeriodicCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=4)
    callbacks = [checkpoint, *{"early_stopping": [EarlyStopping("val", patience=0)], "preemption": [Preempt()]}
                 .get(stop, [])]
    strategy = {"strategy": LLMParallelStrategy(), "accelerator": "cpu", "devices": 1} if stop == "preemption" else {}
    trainer = Trainer(max_steps=6 if stop == "max_steps" else 20, logger=False, callbacks=callbacks,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                      val_check_interval=3, num_sanity_val_steps=0, **strategy)
    with contextlib.suppress(SIGTERMException):
        trainer.fit(Model())  # 32 batches an epoch
    last = Path(checkpoint.last_model_path)
    assert last.name == "last.ckpt", last
    saved = torch.load(last / "meta.pt" if last.is_dir() else last, weights_only=True)
    return saved["global_step"], saved["epoch"]


@pytest.mark.parametrize("stop", ["max_steps", "early_stopping", "preemption"])
def test_final_checkpoint_holds_the_last_step_mid_epoch(tmp_path: Path, stop: str) -> None:
    # ModelCheckpoint saves `last` at the end only if it never saved: a 60-step run with saves every 50 reported
    # step 50's. And a save at the end of training records the epoch as finished, so a run resumed from it started
    # the next epoch's data. The command's default saves the last step where the run is known to stop; after a
    # SIGTERM (noted during step 5, acted on before step 6, which is then the last) under LLMParallelStrategy too.
    assert run_ranks(_last_step_saved, 1, stop, str(tmp_path), timeout=120)[0] == (6, 0)


def test_cli_resumes_mid_epoch_on_the_batches_of_an_unstopped_run(tmp_path: Path) -> None:
    # dp2: each rank's share of one shuffled order. Stopped at step 5 (the end-of-run checkpoint) and resumed with
    # --ckpt_path last, the run goes on with the epoch's next batches: its losses are the unstopped run's. (Before,
    # the resumed epoch started its data again, and "last" found nothing in the new run's folder; the warm-up spans
    # all 10 steps, so the learning rates agree.)
    def losses(name: str, steps: int, *extra: str, folder: str = "",
               output: list[str] | None = None) -> tuple[dict[int, float], dict[str, str]]:
        out = tmp_path / (folder or name)
        report = _train_from_single(tmp_path, "--trainer.max_steps", str(steps), "--trainer.log_every_n_steps", "1",
                                    "--trainer.limit_val_batches", "0", "--trainer.logger",
                                    "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(out),
                                    "--model.n_layer", "2", "--model.n_embd", "64", "--data.block_size", "64", *extra,
                                    output=output)
        rows = csv.DictReader(sorted(out.rglob("metrics.csv"))[-1].open())  # this run's version
        return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}, report

    whole, _ = losses("whole", 10)
    first, report = losses("first", 5)
    assert torch.load(Path(report["checkpoint"]) / "meta.pt", weights_only=True)["global_step"] == 5
    # With a worker process, which draws indices as soon as the loader's iterator exists (before any callback).
    printed: list[str] = []
    rest, _ = losses("rest", 10, "--ckpt_path", "last", "--data.num_workers", "1", folder="first", output=printed)
    assert sorted(first) == [0, 1, 2, 3, 4] and sorted(rest) == [5, 6, 7, 8, 9], (first, rest)
    # max_steps is the schedule's length: the restored scheduler goes on with the longer one, and the run says so.
    assert "another learning-rate schedule than the checkpoint's (total_steps 5 -> 10" in printed[0], printed[0][-3000:]
    for step, loss in {**first, **rest}.items():
        assert abs(loss - whole[step]) <= 1e-6 * max(1.0, abs(loss)), (step, loss, whole[step])


def test_ckpt_path_last_finds_an_earlier_run_of_a_users_checkpoint_callback(tmp_path: Path) -> None:
    # A user's ModelCheckpoint without dirpath writes into each run's logger folder too, where Lightning looks for
    # "last" only in the new run's (empty) one: the run started again from step 0, saying only that no last
    # checkpoint was available. With a dirpath, Lightning finds it itself.
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_llmpar.cli.resume import newest_run_checkpoint

    earlier = tmp_path / "logs" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    earlier.parent.mkdir(parents=True)
    earlier.write_bytes(b"a checkpoint")

    def trainer(**kw: Any) -> Trainer:
        return Trainer(logger=CSVLogger(tmp_path / "logs"), callbacks=[ModelCheckpoint(save_last=True, **kw)],
                       enable_progress_bar=False, enable_model_summary=False)

    assert newest_run_checkpoint(trainer()) == earlier
    assert newest_run_checkpoint(trainer(dirpath=tmp_path / "mine")) is None


def test_ckpt_path_last_takes_the_newest_run_of_this_model_and_data(tmp_path: Path) -> None:
    # Runs of other configs share runs/llmpar (a sweep): "last" took the newest of any, and a model of the same
    # shapes but another learning rate or rotary base resumed from it without a word. The newest run whose saved
    # model and data sections equal this run's is taken; the trainer's settings (the layout) and the loaders' worker
    # counts may differ; a run that saved no config is taken on trust; none of this config is refused, by name.
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_llmpar.cli.resume import newest_run_checkpoint

    def config(lr: float, workers: int = 0, devices: int = 1) -> dict[str, Any]:
        return {"trainer": {"devices": devices},
                "model": {"class_path": "my.Model", "init_args": {"n_embd": 64, "learning_rate": lr}},
                "data": {"class_path": "my.Data", "init_args": {"batch_size": 8, "num_workers": workers}}}

    def run(version: int, saved: dict[str, Any] | None, age: float) -> Path:
        last = tmp_path / "logs" / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"
        last.parent.mkdir(parents=True)
        last.write_bytes(b"a checkpoint")
        os.utime(last, (time.time() - age, time.time() - age))
        if saved is not None:
            (last.parent.parent / "config.yaml").write_text(yaml.safe_dump(saved))
        return last

    a = run(0, config(1e-3), age=30)
    run(1, config(3e-4), age=20)  # a sweep's other learning rate, newer
    trainer = Trainer(logger=CSVLogger(tmp_path / "logs"), callbacks=[ModelCheckpoint(save_last=True)],
                      enable_progress_bar=False, enable_model_summary=False)
    assert newest_run_checkpoint(trainer, config(1e-3, workers=2, devices=4)) == a
    with pytest.raises(ValueError, match=r"differs in model\.init_args\.learning_rate: 0\.0003 -> 0\.01.*version_1"):
        newest_run_checkpoint(trainer, config(1e-2))
    unknown = run(2, None, age=10)
    assert newest_run_checkpoint(trainer, config(1e-2)) == unknown


def test_schedule_spans_an_epoch_bounded_run() -> None:
    # `llmpar fit` links trainer.max_steps into the model's total_steps: -1 for a run bounded by epochs (and in
    # configs `llmpar plan` wrote), where the cosine used to drop to its 10% floor right after the warm-up.
    from lightning.pytorch import Callback, Trainer

    from lightning_llmpar.models import GPTModule

    class Rates(Callback):
        def __init__(self) -> None:
            self.rates: list[float] = []

        def on_train_batch_start(self, trainer: Trainer, *args: object) -> None:
            self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])

    module = GPTModule(n_layer=1, n_head=2, n_kv_head=1, n_embd=16, block_size=8, learning_rate=1.0, warmup_steps=2,
                       total_steps=-1)
    data = torch.utils.data.DataLoader([(torch.zeros(8, dtype=torch.long),) * 2] * 10, batch_size=2)  # 5 batches
    trainer = Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[rates := Rates()])
    trainer.fit(module, data)
    assert len(rates.rates) == 10
    assert rates.rates[:2] == [0.5, 1.0] and rates.rates[2] == pytest.approx(1.0)  # warm-up, then the peak
    assert all(a > b for a, b in zip(rates.rates[2:], rates.rates[3:]))  # decaying over the whole run
    assert rates.rates[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))


@pytest.fixture
def in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-device run of the command inside the test process, which leaves nothing behind: the strategy's process
    group and the launcher's variables (MASTER_PORT, ...) would reach later tests and their subprocesses."""
    environ = dict(os.environ)
    monkeypatch.chdir(tmp_path)
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


@pytest.mark.parametrize("subcommand", ["test", "predict"])
@pytest.mark.usefixtures("in_process")
def test_test_and_predict_run_on_the_default_model_and_data(subcommand: str) -> None:
    # They failed after start-up: the example GPT had no test_step, the corpus no test or predict loader.
    cli = main([subcommand, "--config", str(ROOT / "examples/configs/single.yaml"), "--trainer.logger", "false",
                "--model.n_layer", "1", "--model.n_embd", "32", "--data.block_size", "32", "--data.max_bytes", "40000",
                f"--trainer.limit_{subcommand}_batches", "2", "--trainer.enable_progress_bar", "false"])
    if subcommand == "test":
        assert {"test/loss", "test/ppl"} <= set(cli.trainer.callback_metrics)
    else:
        predictions = cli.trainer.predict_loop.predictions
        assert len(predictions) == 2 and predictions[0].shape == (8, 32)  # the next token at each position


@pytest.mark.usefixtures("in_process")
def test_overfit_batches_runs_on_the_bundled_data() -> None:
    # Lightning swaps a sequential sampler into the resumable loader for overfit_batches; the loader then has no
    # position to keep (it refused that sampler).
    cli = main(["fit", "--config", str(ROOT / "examples/configs/single.yaml"), "--trainer.logger", "false",
                "--model.n_layer", "1", "--model.n_embd", "32", "--data.block_size", "32", "--data.max_bytes", "40000",
                "--trainer.overfit_batches", "2", "--trainer.max_steps", "3", "--trainer.val_check_interval", "1",
                "--trainer.enable_progress_bar", "false"])
    assert cli.trainer.global_step == 3


@pytest.mark.usefixtures("in_process")
def test_strategy_given_as_a_bare_class_path() -> None:
    # jsonargparse keeps a class path with no init_args as a string, which Lightning took for an unknown name.
    args = ["--config", str(ROOT / "examples/configs/3d.yaml"), "--trainer.strategy", "lightning_llmpar.LLMParallelStrategy",
            "--trainer.devices", "2", "--trainer.logger", "false"]
    assert isinstance(main(args, run=False).trainer.strategy, LLMParallelStrategy)
    with pytest.raises(ValueError, match="lightning_llmpar.NoSuchStrategy: neither a registered strategy name"):
        main([*args[:3], "lightning_llmpar.NoSuchStrategy", *args[4:]], run=False)


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize("given", ["90", "0:01:30"])
def test_process_group_timeout_given_in_seconds_or_as_a_duration(given: str) -> None:
    # A number of seconds was refused by the command line, which only took a timedelta's "H:MM:SS".
    args = ["--config", str(ROOT / "examples/configs/3d.yaml"), "--trainer.strategy.timeout", given,
            "--trainer.logger", "false"]
    assert main(args, run=False).trainer.strategy._timeout == timedelta(seconds=90)


def test_llmpar_fit_stopped_by_a_sigterm_exits_with_its_status(monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning stops a run after a SIGTERM with SIGTERMException, a SystemExit without a code: the command exited
    # 0, and a retry policy (Kubernetes, a workflow engine) counted the preempted run as finished.
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    def preempted() -> None:
        raise SIGTERMException

    command = sys.modules["lightning_llmpar.cli.main"]  # the module (the package exports its `main` function)
    monkeypatch.setattr(command, "main", preempted)
    monkeypatch.setattr(sys, "argv", ["llmpar", "fit"])
    with pytest.raises(SystemExit) as stopped:
        command.console()
    assert stopped.value.code == 143
