"""Memory sizes on the command line."""

from __future__ import annotations

import pytest

from autotune.core.bytesize import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "size_bytes"),
    [
        ("2GiB", 2 * 2**30),
        ("1500MiB", 1500 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("3GB", 3 * 10**9),
        ("4096", 4096),
        ("512 kib", 512 * 1024),
        ("10B", 10),
    ],
)
def test_parse(text: str, size_bytes: int) -> None:
    assert parse_bytes(text) == size_bytes


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "2 parsecs", "0", "1.5.2GiB", "2XiB"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(text)


def test_format() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
