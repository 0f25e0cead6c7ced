"""The torch-free layers stay torch-free: every module of `autotune/core/`, `autotune/remote/`,
`autotune/cli/` and `api/` imports without loading torch, optuna, numpy or transformers, so the
server and the client install and start without them. The folders are walked, not listed: a new
module is checked the day it lands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCH_FREE = ("autotune/core", "autotune/remote", "autotune/cli", "api")
# Alembic's env.py runs migrations when imported; it is loaded by alembic, not by us.
NOT_IMPORTABLE = {"api.migrations.env"}

CHECK = """
import importlib, sys, tempfile
from pathlib import Path
for name in sys.argv[1:]:
    importlib.import_module(name)
import api.main
from api.settings import Settings
app = api.main.create_app(Settings(data_dir=Path(tempfile.mkdtemp())))
heavy = sorted(m for m in ("torch", "optuna", "numpy", "transformers") if m in sys.modules)
assert not heavy, heavy
print("clean")
"""


def torch_free_modules() -> list[str]:
    names = []
    for folder in TORCH_FREE:
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if name not in NOT_IMPORTABLE and "versions" not in parts:
                names.append(name)
    return names


def test_the_walk_sees_every_layer() -> None:
    names = torch_free_modules()
    for expected in (
        "autotune.core.search.micro_batch",
        "autotune.remote.client",
        "autotune.cli.main",
        "api.main",
    ):
        assert expected in names


@pytest.mark.e2e
def test_torch_free_layers_never_import_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK, *torch_free_modules()],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "clean"
