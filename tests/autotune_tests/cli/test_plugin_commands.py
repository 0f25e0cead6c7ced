"""The commands other deployables plug in (autotune/cli/main.py, autotune/core/plugins.py): a
command whose extra is missing says which extra to install (exit 2), a command whose module is
broken shows its own error, and neither ever turns into argparse's "invalid choice".

Each case runs the real `autotune` command in a child process in which some modules cannot be
imported, the way they cannot on a machine without the extra: a meta path finder placed first
refuses them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.core.plugins import COMMAND_GROUP, RECORDER_GROUP, plugins
from tests.conftest import free_port

# The child: refuse the modules in BLOCKED (a top-level name blocks its submodules too), then
# run the CLI. ("missing", M): as if importing it needed module M, which is not installed;
# ("broken", text): an ImportError of our own code.
_CHILD = """
import json, sys

BLOCKED = json.loads(sys.argv[1])

class Refuse:
    def find_spec(self, name, path=None, target=None):
        for blocked, (kind, detail) in BLOCKED.items():
            if name == blocked or name.startswith(blocked + "."):
                if kind == "missing":
                    raise ModuleNotFoundError(f"No module named {detail!r}", name=detail)
                raise ImportError(detail)
        return None

sys.meta_path.insert(0, Refuse())
from autotune.cli.main import main
sys.exit(main(sys.argv[2:]))
"""

MEMORY = ["--device", "cpu", "--memory", "1GiB"]


def missing(module: str) -> tuple[str, str]:
    return ("missing", module)


def autotune(
    blocked: dict[str, tuple[str, str]], *argv: str, cwd: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(blocked), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=os.environ | {"COLUMNS": "200"},  # argparse and Rich: no wrapped lines
    )


def test_the_commands_of_every_deployable_are_entry_points() -> None:
    commands = {plugin.name: plugin.extra for plugin in plugins(COMMAND_GROUP)}
    assert commands == {
        "tune": "probe",
        "submit": None,
        "runs": None,
        "serve": "api",
        "worker": "probe",
    }
    assert [plugin.name for plugin in plugins(RECORDER_GROUP)] == ["database"]


def test_serve_without_the_api_extra_says_what_to_install(tmp_path: Path) -> None:
    done = autotune({"fastapi": missing("fastapi")}, "serve", "--port", "0", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "autotune serve: needs the 'api' extra (No module named 'fastapi'): "
        "pip install 'autotune[api]'\n"
    )


def test_serve_without_torch_says_that_estimates_need_a_worker(tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    argv = ["serve", "--port", str(free_port()), "--db", f"sqlite:///{tmp_path / 'runs.db'}"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps({"torch": missing("torch")}), *argv],
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    expected = (
        "autotune serve: estimates need a worker: torch is not installed here "
        "(pip install 'autotune[probe]')"
    )
    try:
        deadline_s = time.monotonic() + 60
        while expected not in log_path.read_text():
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline_s, log_path.read_text()
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert "estimates run here" not in log_path.read_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--token", "t", *MEMORY, "--once", "--server", "http://127.0.0.1:9"],
        ["probe", "spec.yaml", *MEMORY],
    ],
)
def test_torch_commands_without_torch_say_what_to_install(argv: list[str], tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text("model: {preset: mlp}\n")
    done = autotune({"torch": missing("torch")}, *argv, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"autotune {argv[0]}: needs the 'probe' extra (No module named 'torch'): "
        "pip install 'autotune[probe]'\n"
    )


def test_a_command_module_that_cannot_import_its_extra_still_explains_itself(
    tmp_path: Path,
) -> None:
    """As if probes/cli.py imported torch at the top: the command is still listed, and runs."""
    blocked = {"probes.cli": missing("torch")}
    listing = autotune(blocked, "--help", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert "not installed: pip install 'autotune[probe]'" in listing.stdout
    done = autotune(blocked, "worker", "--token", "t", "--help", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "pip install 'autotune[probe]'" in done.stderr
    assert "invalid choice" not in done.stderr


def test_a_broken_command_module_surfaces_its_own_error(tmp_path: Path) -> None:
    """Any other import error is a bug: shown as it is, when the command runs, and the other
    commands keep working."""
    blocked = {"probes.cli": ("broken", "cannot import name 'Worker' from 'probes.worker'")}
    done = autotune(blocked, "worker", "--token", "t", *MEMORY, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.rstrip().endswith(
        "ImportError: cannot import name 'Worker' from 'probes.worker'"
    )
    assert "invalid choice" not in done.stderr
    assert "pip install" not in done.stderr
    assert autotune(blocked, "submit", "--help", cwd=tmp_path).returncode == 0


def test_a_broken_library_module_is_not_called_a_missing_extra(tmp_path: Path) -> None:
    """A ModuleNotFoundError naming our own package is our bug, never "install an extra"."""
    blocked = {"autotune.engine.devices.device": missing("autotune.engine.devices.device")}
    (tmp_path / "spec.yaml").write_text("model: {preset: mlp}\n")
    done = autotune(blocked, "probe", "spec.yaml", *MEMORY, cwd=tmp_path)
    assert done.returncode == 1
    assert "ModuleNotFoundError: No module named 'autotune.engine.devices.device'" in done.stderr
    assert "pip install" not in done.stderr


@pytest.mark.e2e
def test_tune_records_through_the_installed_recorder_and_skips_it_without_the_server(
    tmp_path: Path,
) -> None:
    """`autotune tune` records its run through the `autotune.recorders` entry point, which the
    server package provides; without that package it still tunes. 20 MiB is too small for one
    sample of the mlp preset, so the tuning itself is quick (and answers "nothing fits": 1)."""
    (tmp_path / "spec.yaml").write_text(
        "model: {preset: mlp}\ntraining: {target_global_batch: 8}\n"
    )
    argv = ["tune", "spec.yaml", "--device", "cpu", "--memory", "20MiB", "--no-advice"]
    argv += ["--seconds-per-trial", "0.05", "--db", f"sqlite:///{tmp_path / 'runs.db'}"]
    recorded = autotune({}, *argv, cwd=tmp_path)
    assert recorded.returncode == 1, recorded.stderr
    assert "not even a micro-batch of 1 fits" in recorded.stdout
    assert f"recorded as run 1 in sqlite:///{tmp_path / 'runs.db'}" in recorded.stderr

    without_server = autotune({"sqlalchemy": missing("sqlalchemy")}, *argv, cwd=tmp_path)
    assert without_server.returncode == 1, without_server.stderr
    assert "not even a micro-batch of 1 fits" in without_server.stdout
    assert "recorded" not in without_server.stderr
    assert "Traceback" not in without_server.stderr
