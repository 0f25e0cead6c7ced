"""Edits to a parsed config file, applied in place so that a round-trip YAML mapping keeps its
comments and key order: set a key, merge keys into a nested mapping, or remove a key."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Final


class Merge(dict[str, Any]):
    """Keys to set inside the mapping found at this key (made when the file has none), leaving
    its other keys as they are."""


class _Remove:
    def __repr__(self) -> str:
        return "REMOVE"


REMOVE: Final = _Remove()  # the key is taken out of the file


def apply_edits(target: MutableMapping[str, Any], edits: dict[str, Any]) -> None:
    """`edits` made to `target`, in place; keys it lacks are added at its end."""
    for key, value in edits.items():
        if value is REMOVE:
            target.pop(key, None)
        elif isinstance(value, Merge):
            inner = target.get(key)
            if not isinstance(inner, MutableMapping):
                inner = {}
                target[key] = inner
            apply_edits(inner, value)
        else:
            target[key] = value
