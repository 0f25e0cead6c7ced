"""Mutation testing: which small code changes the fast tests of a module fail to notice.

Runs mutmut (v3, from the `dev` extra) over one module with only the tests that exercise it, in
a scratch copy of the repository so that mutmut's `mutants/` tree never lands in the checkout,
at `nice -n 10` because the machine is shared. Prints the survivors and writes the counts to
`bench/results/mutation-<module>.json`; `bench/results/mutation.md` explains every survivor.

    .venv/bin/python bench/mutation.py search            # one module
    .venv/bin/python bench/mutation.py search tracker    # several, one after another
    .venv/bin/python bench/mutation.py --list            # modules and their test sets

The module -> tests map below is the reproducible part: a mutant is killed only by these tests.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
COPIED = ("autotune", "api", "probes", "tests", "pyproject.toml", "README.md", "docs")


@dataclass(frozen=True)
class Target:
    source: str
    tests: tuple[str, ...]
    # Functions to mutate (mutmut names them `module.x_function`); empty: the whole module.
    only: tuple[str, ...] = ()


TARGETS = {
    "search": Target("autotune/core/search.py", ("tests/autotune_tests/core/test_search.py",)),
    "tracker": Target(
        "autotune/engine/tracker.py",
        (
            "tests/autotune_tests/engine/test_tracker.py",
            "tests/autotune_tests/engine/test_device.py",
        ),
    ),
    "step": Target("autotune/engine/step.py", ("tests/autotune_tests/engine/test_step.py",)),
    # The lease state machine: claim, heartbeat, the holder check, failure and expiry.
    "leases": Target(
        "api/crud.py",
        (
            "tests/api_tests/test_worker_protocol.py",
            "tests/api_tests/test_local_runs.py",
        ),
        only=(
            "claim_run",
            "_held_run",
            "_renew",
            "heartbeat",
            "fail_claim",
            "_end_claim",
            "expire_leases",
            "has_expired_leases",
            "_match_clause",
        ),
    ),
}


def _mutmut_section(target: Target) -> str:
    tests = ", ".join(json.dumps(t) for t in target.tests)
    lines = [
        "[tool.mutmut]",
        f"source_paths = [{json.dumps(target.source)}]",
        f"pytest_add_cli_args_test_selection = [{tests}]",
        # Fixed order and first failure: a mutant is killed by its first failing test.
        'pytest_add_cli_args = ["-p", "no:randomly", "-q", "-x"]',
    ]
    return "\n".join(lines) + "\n"


def _mutant_globs(target: Target) -> list[str]:
    """mutmut names a mutant `module.x_function__mutmut_N` (methods: `module.xǁClassǁ...`)."""
    module = target.source.removesuffix(".py").replace("/", ".")
    return [f"{module}.x_{name}__mutmut_*" for name in target.only]


def _prepare(workdir: Path, target: Target) -> None:
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, workdir / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, workdir / name)
    pyproject = workdir / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    # Replace the checkout's default section with this target's.
    text = re.sub(r"\n\[tool\.mutmut\]\n(?:[^\[].*\n|\n)*", "\n", text)
    pyproject.write_text(text + "\n" + _mutmut_section(target), encoding="utf-8")
    tomllib.loads(pyproject.read_text(encoding="utf-8"))  # still valid TOML


def _mutmut(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = ["nice", "-n", "10", str(Path(sys.executable).parent / "mutmut"), *args]
    return subprocess.run(command, cwd=workdir, capture_output=True, text=True, check=False)


def run(name: str, max_children: int) -> dict[str, object]:
    target = TARGETS[name]
    with tempfile.TemporaryDirectory(prefix=f"mutation-{name}-") as tmp:
        workdir = Path(tmp)
        _prepare(workdir, target)
        started = time.monotonic()
        globs = _mutant_globs(target)
        done = _mutmut(workdir, "run", "--max-children", str(max_children), *globs)
        elapsed_s = time.monotonic() - started
        if done.returncode != 0:
            raise SystemExit(f"mutmut run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        statuses: dict[str, int] = {}
        survivors = []
        for line in _mutmut(workdir, "results", "--all", "true").stdout.splitlines():
            mutant, _, status = line.strip().partition(": ")
            if not status or (globs and not any(fnmatch.fnmatch(mutant, g) for g in globs)):
                continue
            statuses[status] = statuses.get(status, 0) + 1
            if status == "survived":
                diff = _mutmut(workdir, "show", mutant).stdout
                survivors.append({"mutant": mutant, "diff": diff})
        stats = {"mutants": sum(statuses.values()), **statuses}
    summary: dict[str, object] = {
        "module": target.source,
        "tests": list(target.tests),
        "only": list(target.only),
        "elapsed_s": round(elapsed_s, 1),
        "stats": stats,
        "survivors": survivors,
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"mutation-{name}.json"
    out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"{name}: {json.dumps(stats)} in {elapsed_s:.0f} s -> {out.relative_to(ROOT)}")
    for survivor in survivors:
        print(survivor["diff"])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help=f"any of {', '.join(TARGETS)}")
    parser.add_argument("--list", action="store_true", help="print the module -> tests map")
    parser.add_argument("--max-children", type=int, default=2, help="parallel test runs")
    args = parser.parse_args()
    if args.list or not args.modules:
        for name, target in TARGETS.items():
            print(f"{name}: {target.source} <- {' '.join(target.tests)}")
        return
    unknown = set(args.modules) - set(TARGETS)
    if unknown:
        parser.error(f"unknown module(s) {', '.join(sorted(unknown))}; use {', '.join(TARGETS)}")
    for name in args.modules:
        run(name, args.max_children)


if __name__ == "__main__":
    main()
