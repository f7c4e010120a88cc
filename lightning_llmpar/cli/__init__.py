"""The `llmpar` command (LightningCLI for any module and data) and its verbs."""

from lightning_llmpar.cli.main import LLMParCLI, console, main

__all__ = ["LLMParCLI", "console", "main"]
