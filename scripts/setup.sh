#!/usr/bin/env bash
# Installs lightning_llmpar and its test dependencies into the current Python, quickly and idempotently.
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build first, so that resolving the
# other dependencies never pulls the multi-gigabyte CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip install --quiet --disable-pip-version-check --root-user-action=ignore"

if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PIP "torch>=2.11"
  else
    $PIP "torch==2.13.0"
  fi
fi
# Editable install with the test extras; everything already present is left as it is.
$PIP -e ".[dev]"
# LitGPT for its model zoo tests and example. Its pins (jsonargparse<=4.41, huggingface-hub<1.4, psutil==7.2.2)
# conflict with transformers 5 and our jsonargparse; its model code needs only torch, lightning and PyYAML.
$PIP --no-deps "litgpt==0.5.13"
# The linter .ci/run runs, pinned so that a new release's rules never fail a commit that passed.
$PIP "ruff==0.17.6"
# Fault-tolerant replica groups (fault_tolerance="torchft"); its lighthouse server is inside the wheel.
$PIP "torchft==0.2.0"
# DeepSpeed compiles its CPU communication op the first time a process group starts; build it here,
# once per machine (cached under ~/.cache/torch_extensions), rather than inside a timed test.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  $PY - <<'PYEOF' >/dev/null 2>&1 || echo "note: DeepSpeed's CPU comm op was not prebuilt; it will build on first use"
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
    builder.load()
PYEOF
fi
$PY -c "import lightning_llmpar, torch; print(f'lightning_llmpar {lightning_llmpar.__version__} ready (torch {torch.__version__})')"
