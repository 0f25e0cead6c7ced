"""Replaying an allocation trace through the allocator model
(docs/design.md#the-caching-allocator-model)."""

from __future__ import annotations

import pytest

from autotune.core.memory.allocation_trace import (
    Alloc,
    AllocationModel,
    Free,
    encode,
    replay,
    replay_encoded,
)
from autotune.core.memory.allocator_config import MIB, parse_alloc_conf


def test_a_trace_that_fits_reports_the_final_and_peak_figures() -> None:
    events = [Alloc(6 * MIB), Alloc(6 * MIB), Free(0), Alloc(30 * MIB), Free(3), Alloc(0)]
    result = replay(events, 100 * MIB)
    assert result.fits and result.failed_event is None
    stats = result.stats
    assert (stats.allocated_bytes, stats.reserved_bytes) == (6 * MIB, 50 * MIB)
    assert (stats.peak_allocated_bytes, stats.peak_reserved_bytes) == (36 * MIB, 50 * MIB)


def test_a_trace_stops_at_the_allocation_that_runs_out() -> None:
    events = [Alloc(60 * MIB), Free(0), Alloc(70 * MIB), Alloc(40 * MIB), Alloc(1)]
    result = replay(events, 100 * MIB)
    assert not result.fits
    assert result.failed_event == 3
    assert result.out_of_memory is not None
    assert result.out_of_memory.requested_bytes == 40 * MIB
    assert (result.stats.num_alloc_retries, result.stats.num_ooms) == (2, 1)


def test_the_config_changes_the_outcome() -> None:
    events = [Alloc(12 * MIB), Alloc(12 * MIB)]
    assert replay(events, 30 * MIB).fits
    assert not replay(events, 30 * MIB, parse_alloc_conf("expandable_segments:True")).fits


@pytest.mark.parametrize("events", [[Free(0)], [Alloc(1), Free(0), Free(0)], [Alloc(1), Free(5)]])
def test_a_free_of_nothing_is_refused(events: list[Alloc | Free]) -> None:
    with pytest.raises(ValueError, match="holds no storage"):
        replay(events, 100 * MIB)


def test_the_encoding_is_what_the_tracker_records() -> None:
    events = [Alloc(6 * MIB), Alloc(0), Free(0), Alloc(1)]
    assert encode(events) == [6 * MIB, 0, -1, 1]
    assert replay_encoded(encode(events), 100 * MIB) == replay(events, 100 * MIB)


def _trace(micro_batch: int) -> list[int]:
    # Weights, an activation kept and a temporary freed, then the activation freed.
    return [8 * MIB, micro_batch * 3 * MIB, micro_batch * MIB + 512, -3, -2]


def test_an_allocation_model_predicts_every_size_from_two_traces() -> None:
    model = AllocationModel.fit(2, _trace(2), 4, _trace(4))
    assert model is not None
    for micro_batch in (0, 1, 3, 7, 100):
        assert model.trace(micro_batch) == _trace(micro_batch)
    # At b = 7 the 8 MiB weights get a 20 MiB segment (a 1-10 MiB request), whose rest serves
    # the 7 MiB temporary; the 21 MiB activation gets its own, rounded to 22 MiB.
    assert model.replay(7, 100 * MIB).stats.peak_reserved_bytes == (20 + 22) * MIB


def test_an_allocation_model_finds_where_reserved_memory_runs_out() -> None:
    model = AllocationModel.fit(2, _trace(2), 3, _trace(3))
    assert model is not None
    capacity_bytes = 60 * MIB
    answer = max(b for b in range(1, 64) if replay_encoded(_trace(b), capacity_bytes).fits)
    assert model.largest_fitting(capacity_bytes, above=0, high=64) == answer
    # Within a budget: the peak reserved with the whole capacity there, not a smaller card.
    budget_bytes = 40 * MIB
    replays = {b: replay_encoded(_trace(b), capacity_bytes) for b in range(1, 64)}
    within = max(
        b for b, r in replays.items() if r.fits and r.stats.peak_reserved_bytes <= budget_bytes
    )
    found = model.largest_fitting(capacity_bytes, above=0, high=64, budget_bytes=budget_bytes)
    assert found == within < answer
    # Only sizes strictly between the two ends: none there fits.
    assert model.largest_fitting(capacity_bytes, above=answer, high=answer + 6) is None


@pytest.mark.parametrize(
    ("b1", "trace1", "b2", "trace2"),
    [
        (2, [1, 2], 3, [1, 2, 3]),  # another number of events
        (2, [1, 2, -1], 3, [1, 2, -2]),  # a free of another allocation
        (2, [1, -1], 3, [1, 5]),  # a free where the other trace allocates
        (1, [1, 2], 2, [1, 3]),  # b = 1 runs another op sequence
        (2, [], 3, []),
    ],
)
def test_an_allocation_model_refuses_traces_of_other_events(
    b1: int, trace1: list[int], b2: int, trace2: list[int]
) -> None:
    assert AllocationModel.fit(b1, trace1, b2, trace2) is None


def test_an_allocation_model_needs_two_sizes_in_order() -> None:
    with pytest.raises(ValueError, match="b1 < b2"):
        AllocationModel.fit(3, [1], 3, [1])
