"""The package's shape: one folder per dimension, no import circle, short files, everything a user names in
YAML importable from the top level."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import yaml

import lightning_llmpar

PACKAGE = Path(lightning_llmpar.__file__).parent
ROOT = PACKAGE.parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if name.endswith(".__main__"):
            continue
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules ``path`` imports anywhere (module level or inside functions), TYPE_CHECKING blocks aside."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    deps = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_llmpar"):
            deps.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name.startswith("lightning_llmpar"))
    return deps


def test_no_import_circle() -> None:
    modules = _modules()
    graph = {name: {d for d in _imports(path, modules) if d in modules and d != name and not name.startswith(d + ".")}
             for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, "import circle: " + " -> ".join([*path[path.index(dep):], dep])
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    # Each module as the first package import (an import circle shows up as an ImportError at some entry point).
    names = sorted(_modules())
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m.startswith('lightning_llmpar')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_files_stay_short_and_dimensions_have_folders() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
    for folder in ("tensor_parallel", "pipeline", "data_parallel", "data_parallel/compression", "precision",
                   "activation_checkpointing", "checkpointing", "fault_tolerance", "callbacks", "models", "cli",
                   "strategies"):
        assert (PACKAGE / folder / "__init__.py").is_file(), folder


def test_no_process_group_state_at_module_level() -> None:
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.Expr)) and node.value is not None:
                text = ast.unparse(node.value)
                assert not any(call in text for call in ("new_group(", "init_process_group(", "init_device_mesh(")), (
                    f"{path.relative_to(ROOT)}: {text}"
                )


def test_what_yaml_names_is_importable_from_the_top_level() -> None:
    for name in lightning_llmpar.__all__:
        assert getattr(lightning_llmpar, name) is not None
    for cls in ("LLMParallelStrategy", "BF16Precision", "FP16Precision", "FP8Precision", "ActivationCheckpointing",
                "FaultTolerantCheckpoint", "StepGuard", "ThroughputAndMemory", "PipelineTimeline", "HFCheckpointExport"):
        assert cls in lightning_llmpar.__all__, cls
    paths = set()
    for config in (ROOT / "examples" / "configs").glob("*.yaml"):
        def walk(node: object) -> None:
            if isinstance(node, dict):
                if isinstance(node.get("class_path"), str):
                    paths.add(node["class_path"])
                for value in node.values():
                    walk(value)
            elif isinstance(node, list):
                for value in node:
                    walk(value)

        walk(yaml.safe_load(config.read_text()))
    for path in sorted(p for p in paths if p.startswith("lightning_llmpar")):
        module, _, name = path.rpartition(".")
        assert module in ("lightning_llmpar", "lightning_llmpar.models", "lightning_llmpar.data"), path
        assert hasattr(__import__(module, fromlist=[name]), name), path
