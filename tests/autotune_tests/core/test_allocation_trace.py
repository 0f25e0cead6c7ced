"""Replaying an allocation trace through the allocator model
(docs/design.md#the-caching-allocator-model)."""

from __future__ import annotations

import pytest

from autotune.core.allocation_trace import Alloc, Free, replay
from autotune.core.allocator_config import MIB, parse_alloc_conf


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
