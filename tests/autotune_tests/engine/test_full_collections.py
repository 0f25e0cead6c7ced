"""Full collections are off while a probe, a tune or a search runs, and only then
(autotune/engine/full_collections.py)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from autotune.core.schemas import Spec
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.full_collections import few_full_collections
from autotune.engine.probe import probe

# More surviving objects than a full collection waits for (a quarter of the heap), in small
# containers the collector tracks.
SURVIVORS = 600_000


@pytest.fixture
def collections() -> Iterator[list[tuple[int, tuple[int, int, int]]]]:
    """Each collection's generation, with the thresholds it ran under."""
    seen: list[tuple[int, tuple[int, int, int]]] = []

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            seen.append((info["generation"], gc.get_threshold()))

    gc.callbacks.append(record)
    yield seen
    gc.callbacks.remove(record)


def _make_survivors() -> list[list[int]]:
    return [[n] for n in range(SURVIVORS)]


def test_inside_no_full_collection_runs_and_young_ones_do(
    collections: list[tuple[int, tuple[int, int, int]]],
) -> None:
    before = gc.get_threshold()
    with few_full_collections():
        kept = _make_survivors()
    inside = [generation for generation, _ in collections]
    assert gc.get_threshold() == before
    assert 0 in inside and 2 not in inside
    collections.clear()
    del kept
    kept = _make_survivors()  # the same outside: the collector's own thresholds run a full one
    assert 2 in [generation for generation, _ in collections]
    del kept


def test_nested_and_concurrent_windows_restore_the_thresholds_once_all_leave() -> None:
    before = gc.get_threshold()
    entered, leave = threading.Event(), threading.Event()

    def other_session() -> None:
        with few_full_collections():
            entered.set()
            leave.wait(timeout=30)

    thread = threading.Thread(target=other_session)
    with few_full_collections():
        thread.start()
        assert entered.wait(timeout=30)
        with few_full_collections():
            assert gc.get_threshold()[:2] == before[:2]
        off = gc.get_threshold()
        assert off[2] > 10**6
    assert gc.get_threshold() == off  # the thread's session is still on
    leave.set()
    thread.join(timeout=30)
    assert gc.get_threshold() == before


def test_a_probe_runs_without_full_collections(
    collections: list[tuple[int, tuple[int, int, int]]],
) -> None:
    spec = Spec.model_validate(
        {"model": {"preset": "gpt2-tiny"}, "training": {"seq_len": 16, "max_micro_batch": 4}}
    )
    before = gc.get_threshold()
    probe(spec, EmulatedDevice(1 << 34))
    during = [thresholds for generation, thresholds in collections if thresholds[2] > 10**6]
    assert during, "no collection ran inside the probe's session"
    assert all(generation != 2 for generation, thresholds in collections if thresholds[2] > 10**6)
    assert gc.get_threshold() == before
