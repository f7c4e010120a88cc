"""A first run prints what a user needs: the layout, progress with the loss, the paths at the end; no warning twice
(not once per rank either), no summary column of zeros."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What differs between ranks' copies of one line: torch's logger prefix ("[rank3]:W1126 00:21:16.305000 23945 "),
# Lightning's ("[rank: 3] "), and the rank a message names.
_PER_RANK = [(re.compile(r"^\[rank\d+\]:([A-Z])\d{4} [\d:.]+ \d+ "), r"\1 "), (re.compile(r"^\[rank: \d+\] "), ""),
             (re.compile(r"GLOBAL_RANK: \d+, MEMBER: \d+"), "GLOBAL_RANK: N, MEMBER: N")]
_WARNING = re.compile(r"warn|deprecat|^W ", re.IGNORECASE)


def fit(tmp_path: Path, config: str, *overrides: str) -> str:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    args = ["fit", "--config", str(ROOT / "examples" / "configs" / config), *overrides]
    result = subprocess.run([sys.executable, "-m", "lightning_llmpar.cli", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def repeated_lines(output: str) -> list[str]:
    """Warning lines (and Lightning's per-process lines) printed more than once, ranks' prefixes aside. The
    indented source line Python prints under a warning is not one: two warnings may come from one place."""
    seen: set[str] = set()
    repeated = []
    for raw in output.splitlines():
        if not raw.strip() or raw[0].isspace():
            continue
        line = raw.strip()
        for pattern, replacement in _PER_RANK:
            line = pattern.sub(replacement, line)
        if not (_WARNING.search(line) or line != raw.strip()):
            continue
        if line in seen:
            repeated.append(line)
        seen.add(line)
    return repeated


def assert_quiet(output: str) -> None:
    assert not repeated_lines(output), "\n".join(repeated_lines(output))
    assert "FLOPs" not in output  # Lightning counted none: the column and the total are hidden
    assert "Tip:" not in output and "anonymous setting" not in output
    for key in ("layout", "checkpoint", "W&B run"):
        assert f"llmpar: {key}" in output, output[-3000:]
    assert "train/loss" in output  # the progress bar shows the loss


def test_repeated_lines_are_found_whatever_rank_printed_them() -> None:
    torch_line = "[rank{}]:W1126 00:21:16.30500{} 2394{} site-packages/torch/x.py:390] While redistributing ..."
    assert repeated_lines("\n".join(torch_line.format(r, r, r) for r in range(2))) == [
        "W site-packages/torch/x.py:390] While redistributing ..."]
    two_warnings_one_place = "\n".join(["a.py:43: UserWarning: one", "  warnings.warn(x)",
                                        "a.py:43: UserWarning: two", "  warnings.warn(x)"])
    assert repeated_lines(two_warnings_one_place) == []
    assert repeated_lines("[rank: 1] Seed set to 1234\n[rank: 2] Seed set to 1234") == ["Seed set to 1234"]


def test_main_job_prints_each_warning_once(tmp_path: Path) -> None:
    # The README's main job, shortened: eight processes, tensor-parallel norms over a sharded data-parallel axis.
    output = fit(tmp_path, "3d.yaml", "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
                 "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "2", "--data.max_bytes", "300000")
    assert_quiet(output)
    assert "While redistributing" not in output


def test_llmpar_plan_of_a_transformers_model_says_only_the_plan(tmp_path: Path) -> None:
    """transformers imports torchao when it is installed, which said in every run that its CUDA kernels did not
    load (on a CPU machine) and drew torch's deprecation of its pytree enums: four lines before the table."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_llmpar.cli", "plan", "examples/configs/hf_qwen3.yaml", "--cluster", "cpu",
         "--global-batch", "8", "--seq", "64", "--top", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("qwen3 (examples/hf/tiny-qwen3)") and done.stderr == "", done.stderr[-3000:]
