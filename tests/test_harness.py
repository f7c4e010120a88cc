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
