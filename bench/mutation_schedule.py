"""pytest plugin for bench/mutation.py: how a mutant's tests run, fastest first and on a CPU
allowance each.

mutmut stops a mutant's run at its first failing test (`-x`), so the order decides what a killed
mutant costs: a hand-computed sequence test fails in milliseconds where a sweep over every
capacity takes seconds. A mutant that loops forever is stopped by its CPU time, not by the wall
clock, which on a shared machine says more about the neighbours than about the mutant: each
test may use `_ALLOWANCE` times what it took in the clean run, and at least `_MIN_CPU_S`
(RLIMIT_CPU; SIGXCPU ends the process, which mutmut reports as a timeout).

The durations are the ones mutmut measured in its stats run (`mutmut-stats.json` in the
directory it runs pytest in); in that run itself, tests run as collected and without limits.
Loaded with `-p mutation_schedule` from the scratch tree the runner prepares.
"""

from __future__ import annotations

import json
import math
import resource
from collections.abc import Generator

import pytest

_ALLOWANCE = 10.0
_MIN_CPU_S = 10.0

_duration_s: dict[str, float] = {}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    stats = config.rootpath / "mutmut-stats.json"
    if not stats.exists():
        return
    _duration_s.update(json.loads(stats.read_text(encoding="utf-8"))["duration_by_test"])
    # A test without a measured duration (new since the stats run) goes last, like a slow one.
    items.sort(key=lambda item: _duration_s.get(item.nodeid, math.inf))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    duration_s = _duration_s.get(item.nodeid)
    if duration_s is None:
        return (yield)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(_cpu_s() + max(_ALLOWANCE * duration_s, _MIN_CPU_S))
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    try:
        return (yield)
    finally:
        resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
