"""The replay tests trace whole deep models beside their replays: minutes of end-to-end tests
each, so every module here is `slow` and started first (tests/conftest.py), never the tail of
`make e2e`."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent == _HERE:
            item.add_marker(pytest.mark.slow)
