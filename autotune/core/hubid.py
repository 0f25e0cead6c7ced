"""Hugging Face hub ids: the grammar a spec's `hf_id` must follow (torch-free, no network).

The grammar is the hub's own, as `huggingface_hub.utils.validate_repo_id` states it: `name` or
`namespace/name`; each part 1 to 96 ASCII letters, digits, `_`, `-` or `.`, starting and
ending with a letter, digit or `_`; no `--` or `..` anywhere; not ending in `.git`. So no id
can be `.`, `..`, an absolute path or a path with more than one `/`: an id is only ever looked
up on the hub (and in its local cache), never read as a directory.
"""

from __future__ import annotations

import re

HUB_ID_PART_MAX = 96  # characters in a namespace or a name (the hub's limit)
HUB_ID_MAX = 2 * HUB_ID_PART_MAX + 1

_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?", re.ASCII)


def hub_id_problem(text: str) -> str | None:
    """Why `text` is not a hub id, or None when it is one. The reason never quotes `text`."""
    parts = text.split("/")
    if len(parts) > 2:
        return "expected 'name' or 'namespace/name'"
    for part in parts:
        if not part:
            return "an empty namespace or name"
        if len(part) > HUB_ID_PART_MAX:
            return f"a namespace or name is longer than {HUB_ID_PART_MAX} characters"
        if not _PART.fullmatch(part):
            return (
                "only ASCII letters, digits, '_', '-' and '.' are allowed, and a namespace or "
                "name must start and end with a letter, a digit or '_'"
            )
    if "--" in text or ".." in text:
        return "'--' and '..' are not allowed"
    if text.endswith(".git"):
        return "an id cannot end in '.git'"
    return None


def is_hub_id(text: str) -> bool:
    """True when `text` follows the hub's id grammar (see the module docstring)."""
    return hub_id_problem(text) is None
