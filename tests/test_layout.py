"""The README's layout table matches the tree: every module of the three packages is listed
(by its path, or by its folder where the table names a folder), and every path it lists exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("autotune", "api", "probes")


def layout_paths() -> set[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n| module | what it owns |\n", 1)[1].split("\n\n", 1)[0]
    # A bold first cell heads a layer; the rows under it list its modules.
    rows = [line for line in section.splitlines() if line.startswith("| ") and "**" not in line]
    return {path for row in rows for path in re.findall(r"`([\w./-]+/?)`", row.split("|")[1])}


def modules() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name != "__init__.py":
                found.append(path.relative_to(REPO).as_posix())
    return found


def test_every_module_is_in_the_layout_table() -> None:
    listed = layout_paths()
    folders = {p for p in listed if p.endswith("/")}
    missing = [m for m in modules() if m not in listed and not m.startswith(tuple(folders))]
    assert not missing, f"README.md layout table misses {missing}"


def test_every_listed_path_exists() -> None:
    absent = sorted(p for p in layout_paths() if not (REPO / p).exists())
    assert not absent, f"README.md layout table lists {absent}, which do not exist"


def test_tests_mirror_the_layers() -> None:
    # A test file is named after the module it tests (test_allocator_config.py), optionally with
    # an aspect (test_allocator_torch_tests.py), or after a behaviour of its layer.
    behaviours = {"test_device_gpu.py", "test_plugin_commands.py", "test_readme_factory.py"}
    for layer in ("core", "engine", "cli"):
        modules = [m.stem for m in (REPO / "autotune" / layer).glob("*.py")]
        for test in (REPO / "tests" / "autotune_tests" / layer).glob("test_*.py"):
            stem = test.stem.removeprefix("test_")
            named = any(stem == m or stem.startswith(m + "_") for m in modules)
            assert named or test.name in behaviours, f"{test} tests no module of autotune/{layer}/"


@pytest.mark.e2e
def test_xdist_groups_keep_their_tests_on_one_worker(tmp_path: Path) -> None:
    """`make test` runs with --dist loadgroup: a module's xdist_group keeps its tests, and so
    its module fixtures (tunings, real DDP and FSDP ranks), on one worker. Some pytest releases
    silently stop the grouping (pyproject.toml pins them out); this notices."""
    (tmp_path / "test_grouped.py").write_text(
        "import os\nimport pytest\n\npytestmark = pytest.mark.xdist_group('one')\n\n\n"
        "@pytest.mark.parametrize('i', range(6))\ndef test_worker(i):\n"
        "    print(os.environ['PYTEST_XDIST_WORKER'])\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-v",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    workers = set(re.findall(r"\[(gw\d+)\] .*PASSED", done.stdout))
    assert done.returncode == 0 and len(workers) == 1, done.stdout[-2000:]


def test_every_file_the_server_reads_is_in_its_package_data() -> None:
    """An installed server (the image installs the project as a package) has only what
    package-data lists besides modules: a template or asset missing from it is a 500 there,
    while the tests, running from the repository, pass."""
    import fnmatch
    import tomllib

    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["api"]
    needed = [
        path.relative_to(REPO / "api").as_posix()
        for folder in ("web/templates", "web/static", "migrations")
        for path in (REPO / "api" / folder).rglob("*")
        # script.py.mako is what `alembic revision` writes revisions from: not read at run time.
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".mako"
    ]
    assert needed and all(
        any(fnmatch.fnmatch(name, pattern) for pattern in patterns) for name in needed
    ), [name for name in needed if not any(fnmatch.fnmatch(name, p) for p in patterns)]
