"""One-GPU benchmark in one command: a ~1B-parameter Llama-style model trained through Lightning and
LLMParallelStrategy in bf16 (eager and compiled), FP8 at width 4096, every activation-checkpointing mode, and the
single-device exactness check on CUDA; the planner's prediction for each run beside its measurement.

    python -m benchmarks.gpu                 # on one H100/H200, about 5 minutes; writes benchmarks/results/gpu.json
    python -m benchmarks.gpu --dry-run       # the same code on CPU with a tiny model, about a minute
    python -m benchmarks.gpu --repredict F   # no run: the current planner's predictions beside F's measurements
    python -m benchmarks.gpu.phases          # where one step's memory peaks, tensor by tensor (phases.py)

Every section runs inside its own try/except (a failure is recorded in the JSON with its traceback, the next
section runs), under one global time budget (sections not started in time are recorded as skipped), and each
records its own seconds.
"""
