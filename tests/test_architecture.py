"""The package's shape: one folder per dimension, no import circle, short files, everything a user names in
YAML importable from the top level."""

from __future__ import annotations

import ast
import re
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
    """Package modules ``path`` imports anywhere: module level, inside functions, under TYPE_CHECKING. Every import
    is an edge, wherever it stands: a circle hidden in a function or a type-checking block is still a circle."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_llmpar"):
            deps.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name.startswith("lightning_llmpar"))
    return deps


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {d for d in _imports(path, modules) if d in modules and d != name and not name.startswith(d + ".")}
            for name, path in modules.items()}


def test_no_import_circle() -> None:
    graph = _graph()
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


def test_modeling_imports_nothing_above_it() -> None:
    # Every dimension builds on ``modeling`` (structure, ties, packing, head counts); it depends on no dimension.
    below = ("lightning_llmpar.modeling", "lightning_llmpar.layout")
    for name, deps in _graph().items():
        if name.startswith("lightning_llmpar.modeling"):
            above = sorted(d for d in deps if not d.startswith(below))
            assert not above, f"{name} imports {above}"


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    # Each module as the first package import (an import circle shows up as an ImportError at some entry point).
    # Two interpreters, each taking every other module: the two cores import at once.
    names = sorted(_modules())
    runs = []
    for half in (names[0::2], names[1::2]):
        code = (
            "import importlib, sys\n"
            f"for name in {half!r}:\n"
            "    for loaded in [m for m in sys.modules if m.startswith('lightning_llmpar')]:\n"
            "        del sys.modules[loaded]\n"
            "    importlib.import_module(name)\n"
        )
        runs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for run in runs:
        _, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr[-3000:]


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


def test_no_module_reaches_into_the_strategy() -> None:
    # The strategy's state is its own: backends, callbacks and the set-up get what they need handed to them.
    pattern = re.compile(r"\b(strategy|s)\._[a-z]")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in PACKAGE.rglob("*.py")
             if p.parent.name != "strategies" for i, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert not found, "\n".join(found)


def test_the_model_convention_page_shows_the_name_sets_the_code_uses() -> None:
    # docs/model-convention.md quotes the role name sets of tensor_parallel/families.py: a copy that drifts misleads.
    from lightning_llmpar.tensor_parallel import families

    page = (ROOT / "docs" / "model-convention.md").read_text()
    block = page.split("```python\n", 1)[1].split("```", 1)[0]
    quoted: dict[str, object] = {}
    exec(block, {}, quoted)  # noqa: S102 - our own documentation
    assert quoted, "no name sets quoted"
    for name, value in quoted.items():
        assert getattr(families, name) == value, f"docs/model-convention.md's {name} differs from families.{name}"


def test_benchmarks_and_the_package_import_nothing_from_the_tests() -> None:
    """Benchmarks run from the package alone: what they share with the tests (the launcher, the fault drill)
    lives in the package, never in ``tests/``."""
    offenders = []
    for path in sorted([*ROOT.joinpath("benchmarks").rglob("*.py"), *PACKAGE.rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not offenders, offenders
