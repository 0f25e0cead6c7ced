"""pytest plugin for bench/mutation.py: run a mutant's tests fastest first.

mutmut stops a mutant's run at its first failing test (`-x`), so the order decides what a killed
mutant costs: a hand-computed sequence test fails in milliseconds where a sweep over every
capacity takes seconds. The durations are the ones mutmut measured in its clean stats run
(`mutmut-stats.json` in the directory it runs pytest in); before that run exists, the order is
left alone. Loaded with `-p mutation_order` from the scratch tree the runner prepares.
"""

from __future__ import annotations

import json

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    stats = config.rootpath / "mutmut-stats.json"
    if not stats.exists():
        return
    duration_s: dict[str, float] = json.loads(stats.read_text(encoding="utf-8"))[
        "duration_by_test"
    ]
    # A test without a measured duration (new since the stats run) goes last, like a slow one.
    items.sort(key=lambda item: duration_s.get(item.nodeid, float("inf")))
