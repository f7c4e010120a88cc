"""One gradient reduction per tensor-parallel region, exact whatever else the region does with its input."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.tensor_parallel.regions import BLOCKS, run_case

REGIONS = 2 * BLOCKS  # attention and MLP


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no_sp"])
def test_column_splits_of_a_region_reduce_their_input_gradient_once(sequence_parallel: bool) -> None:
    results = run_ranks(run_case, 2, reader="", inplace=False, sequence_parallel=sequence_parallel)
    for r in results:
        assert r["grad_error"] < 1e-5, r
    backward = results[0]["backward"]
    if sequence_parallel:
        # One reduce-scatter per region (3 column splits in attention, 2 in the MLP); the all-gathers are the
        # backward of the row splits' reduce-scatters.
        assert backward.get("reduce_scatter_tensor") == REGIONS, backward
    else:
        assert backward.get("all_reduce") == REGIONS, backward


@pytest.mark.parametrize(("reader", "sequence_parallel"), [("copy", True), ("copy", False), ("gate", False)])
def test_a_region_reading_its_input_beyond_its_splits_keeps_that_gradient_unsummed(reader: str, sequence_parallel: bool) -> None:
    # "copy": v reads a copy of the input, so its own split reduces its gradient, which is then complete;
    # "gate": the output is scaled by a statistic of the input, a gradient complete on every rank. Either must be
    # added once to the partial sum the other splits reduce, not summed over ranks with it.
    for r in run_ranks(run_case, 2, reader=reader, inplace=False, sequence_parallel=sequence_parallel):
        assert r["grad_error"] < 1e-5, r


def test_a_region_changing_its_input_in_place_still_differentiates_the_change() -> None:
    # The MLP scales its input in place before its projections read it: they must see the change's gradient too.
    results = run_ranks(run_case, 2, reader="", inplace=True, sequence_parallel=False)
    for r in results:
        assert r["grad_error"] < 1e-5, r
    assert results[0]["backward"].get("all_reduce") == BLOCKS * 3, results[0]["backward"]  # attention 1, MLP 2


def test_partial_norm_gradients_are_completed_in_one_all_reduce() -> None:
    # Under sequence parallelism the whole norm weights see this rank's tokens only: DTensor leaves their gradients
    # Partial. The strategy completes them together before clipping and the optimizer read them one by one.
    for r in run_ranks(run_case, 2, reader="", inplace=False, sequence_parallel=True):
        assert len(r["partial"]) == 4 * BLOCKS and all("norm" in n for n in r["partial"]), r  # weight, bias x 2 norms
        assert r["completed"] == 4 * BLOCKS and r["left"] == [], r
        assert r["completing"] == {"c10d.allreduce_.default": 1}, r
        assert r["grad_error"] < 1e-5, r


@pytest.mark.parametrize(("reader", "inplace", "sequence_parallel"),
                         [("", True, False), ("copy", False, True), ("gate", False, False)])
def test_compiled_regions_stay_exact_whatever_they_do_with_their_input(reader: str, inplace: bool,
                                                                       sequence_parallel: bool) -> None:
    # Compiled blocks reduce each split's input gradient on its own (they cannot check the input's version); an
    # in-place change, a copy or a statistic of the input must come out as exact as in eager code.
    for r in run_ranks(run_case, 2, reader=reader, inplace=inplace, sequence_parallel=sequence_parallel, compile=True,
                       timeout=600):
        assert r["grad_error"] < 1e-5, r
