"""Debian's Chromium for the browser tests and the README's screenshots (tests/screenshots.py).

Playwright's own browser download cannot work on a closed network; `make test` installs Debian's
`chromium` package instead, and AUTOTUNE_TEST_CHROMIUM names another binary.
"""

from __future__ import annotations

import os
import shutil

# Without the background-networking flags Chromium keeps trying hosts a closed network refuses;
# without --no-sandbox it will not start as root (CI's user).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    """The Chromium binary to drive, or None when there is none."""
    return os.environ.get("AUTOTUNE_TEST_CHROMIUM") or shutil.which("chromium")
