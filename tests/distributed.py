"""The package's rank launcher (``lightning_llmpar.launch``), with the tests' workloads loaded in its forkserver."""

from lightning_llmpar.launch import NativeCrash, free_port, preload, run_ranks

preload("tests.workloads")

__all__ = ["NativeCrash", "free_port", "run_ranks"]
