from lightning_llmpar.cli.main import console

console()
