"""The package's rank launcher (``lightning_llmpar.launch``), with the tests' workloads loaded in its forkserver.

The forkserver imports once what most tests' ranks import (transformers' model classes pull in accelerate, torchao
and more: about a second per rank), so that each rank forks with them loaded.
"""

from lightning_llmpar.launch import NativeCrash, free_port, preload, run_ranks

preload(
    "tests.workloads",
    "tests.zoo",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
)

__all__ = ["NativeCrash", "free_port", "run_ranks"]
