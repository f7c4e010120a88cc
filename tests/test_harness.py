"""The multi-process launcher the tests rely on: a native crash is reported with where it happened, and relaunched
once; a second crash fails."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from tests.distributed import NativeCrash, run_ranks


def _crash_once(marker: str, always: bool) -> int:
    rank = int(os.environ["RANK"])
    if rank == 1 and (always or not Path(marker).exists()):
        Path(marker).touch()
        ctypes.string_at(0)  # a segmentation fault in native code, as a crash in gloo or a kernel would be
    return rank


def test_native_crash_is_relaunched_once_with_its_stack(tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning, match=r"(?s)rank 1 died \(-11\) at .*string_at.*_crash_once"):
        assert run_ranks(_crash_once, 2, str(tmp_path / "crashed"), False, timeout=60) == [0, 1]


def test_native_crash_twice_fails() -> None:
    with pytest.warns(RuntimeWarning), pytest.raises(NativeCrash, match=r"rank 1 died \(-11\).*\n(.*\n)*.*_crash_once"):
        run_ranks(_crash_once, 2, "", True, timeout=60)


def _raise_on_rank(bad: int) -> int:
    if int(os.environ["RANK"]) == bad:
        raise KeyError("no such thing")
    return 0


def test_a_python_error_names_who_raised_and_who_returned() -> None:
    # Both ranks raising read "only [] of 2 ranks finished (exit codes [0, 0])".
    with pytest.raises(RuntimeError, match=r"(?s)rank 1:.*KeyError: 'no such thing'.*ranks \[0\] of 2 returned, ranks"
                                           r" \[1\] raised \(above\), ranks \[\] never reported"):
        run_ranks(_raise_on_rank, 2, 1, timeout=60)


def test_a_script_starting_ranks_without_a_main_guard_is_told_so(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text("from lightning_llmpar.launch import run_ranks\n\ndef f():\n    return 1\n\nrun_ranks(f, 2, timeout=60)\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode != 0 and 'put that code under `if __name__ == "__main__":`' in out.stderr, out.stderr[-2000:]
