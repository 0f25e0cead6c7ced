"""Parsing and printing memory sizes such as `2GiB`, `1500MiB` or `3.5GB`."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
# Digits bounded: a size has no use for more, and a float of 5,000 digits is infinite.
_PATTERN = re.compile(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([KMGT]?I?B?)\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """Parse `2GiB`, `1500MiB`, `3.5GB` or a plain byte count into bytes.

    Raises:
        ValueError: the text is not a positive size with a known unit (the message does not
            repeat the text: a server says it to whoever sent it).
    """
    match = _PATTERN.fullmatch(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError("not a memory size (try e.g. 2GiB, 1500MiB)")
    size_bytes = int(float(match.group(1)) * _UNITS[unit])
    if size_bytes <= 0:
        raise ValueError("a memory size must be positive")
    return size_bytes


def format_bytes(size_bytes: int) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
