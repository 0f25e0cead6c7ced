"""The server and the client install and start without torch: importing them loads none."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
from pathlib import Path
import tempfile
import api.main, api.runstore, api.leases, api.results, api.cli
import autotune.client, autotune.cli_client, autotune.protocol
from api.settings import Settings
app = api.main.create_app(Settings(data_dir=Path(tempfile.mkdtemp())))
heavy = sorted(m for m in ("torch", "optuna", "numpy", "transformers") if m in sys.modules)
assert not heavy, heavy
print("clean")
"""


def test_api_and_client_never_import_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "clean"
