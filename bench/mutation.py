"""Mutation testing: which small code changes the fast tests of a module fail to notice.

Runs mutmut (v3, from the `dev` extra) over one module with only the tests that exercise it, in
a scratch copy of the repository so that mutmut's `mutants/` tree never lands in the checkout,
at `nice -n 10` with one intra-op thread per test process because the machine is shared. The
counts and every survivor's diff go to `bench/results/mutation.json` (one entry per target,
replaced when that target is run again); `bench/results/mutation.md` is rendered from it and
from `bench/mutation_survivors.toml`, which says why each survivor is harmless.

    .venv/bin/python bench/mutation.py search            # one target
    .venv/bin/python bench/mutation.py leases search     # several, one after another
    .venv/bin/python bench/mutation.py --all             # every target (~35 min of CPU)
    .venv/bin/python bench/mutation.py --report          # re-render mutation.md only
    .venv/bin/python bench/mutation.py --list            # targets and their test sets

The target -> tests map below is the reproducible part: a mutant is killed only by these tests
(mutmut runs, for each mutant, the tests of this set that call the mutated function).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_JSON = ROOT / "bench" / "results" / "mutation.json"
RESULTS_MD = ROOT / "bench" / "results" / "mutation.md"
REASONS = ROOT / "bench" / "mutation_survivors.toml"
# The whole tree the tests import: mutmut puts `mutants/` first on sys.path and removes the
# checkout, so a package missing there would be imported from the editable install instead.
# Lines left unmutated: a call of a module's logger (the whole call, however many lines).
LOG_CALL = r"^\s*logger\.(debug|info|warning|error|exception)\("
COPIED = ("autotune", "api", "probes", "tests", "docs", "pyproject.toml", "README.md")


@dataclass(frozen=True)
class Target:
    source: str
    tests: tuple[str, ...]


TARGETS = {
    # The lease state machine: claim, expiry, renewal, the holder check, a claim's failure.
    "leases": Target("api/store/leases.py", ("tests/api_tests/test_worker_protocol.py",)),
    "search": Target(
        "autotune/core/search/micro_batch.py",
        ("tests/autotune_tests/core/search/test_micro_batch.py",),
    ),
    "tracker": Target(
        "autotune/engine/emulation/tracker.py",
        (
            "tests/autotune_tests/engine/emulation/test_tracker.py",
            "tests/autotune_tests/engine/devices/test_device.py",
            "tests/autotune_tests/engine/devices/test_out_of_memory.py",
        ),
    ),
    # The step's callers test it too: the workloads, CUDA's autocast policy, data parallelism.
    "step": Target(
        "autotune/engine/training/step.py",
        (
            "tests/autotune_tests/engine/training/test_step.py",
            "tests/autotune_tests/engine/training/test_workload.py",
            "tests/autotune_tests/engine/emulation/test_autocast.py",
            "tests/autotune_tests/engine/training/test_data_parallel.py",
        ),
    ),
}


def _mutmut_section(target: Target) -> str:
    def toml_list(items: tuple[str, ...]) -> str:
        return "[" + ", ".join(json.dumps(item) for item in items) + "]"

    lines = [
        "[tool.mutmut]",
        f"source_paths = {toml_list((target.source,))}",
        # mutants/ gets the mutated module plus the rest of the packages it is imported with.
        f"also_copy = {toml_list(('autotune', 'api', 'probes', 'docs', 'README.md'))}",
        f"pytest_add_cli_args_test_selection = {toml_list(target.tests)}",
        # mutmut adds -x -q -p no:randomly itself: the first failure kills, and
        # bench/mutation_schedule.py makes it the fastest test's and stops a test that runs
        # far past its CPU time. No xdist: mutmut already runs --max-children test processes.
        'pytest_add_cli_args = ["-n", "0", "-p", "mutation_schedule"]',
        # Log calls are not mutated: no behaviour depends on them, and each of their mutants
        # would survive through every test of the target (the report says so).
        f"do_not_mutate_patterns = [{json.dumps(LOG_CALL)}]",
    ]
    return "\n".join(lines) + "\n"


def _prepare(workdir: Path, target: Target) -> None:
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, workdir / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, workdir / name)
    pyproject = workdir / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    # Replace the checkout's default section with this target's.
    text = re.sub(r"\n\[tool\.mutmut\]\n(?:[^\[].*\n|\n)*", "\n", text)
    pyproject.write_text(text + "\n" + _mutmut_section(target), encoding="utf-8")
    tomllib.loads(pyproject.read_text(encoding="utf-8"))  # still valid TOML
    # Exists before Python starts: a PYTHONPATH entry that does not exist yet is cached as
    # "no finder" and never searched, even once mutmut creates it.
    (workdir / "mutants").mkdir()
    shutil.copy2(ROOT / "bench" / "mutation_schedule.py", workdir / "mutants")


def _mutmut(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = ["nice", "-n", "10", str(Path(sys.executable).parent / "mutmut"), *args]
    # One intra-op thread per test process: two processes of two threads on two cores wait at
    # every op's barrier for a descheduled peer (tests/conftest.py sets the same under xdist).
    # The mutated tree first for any child process too (a checkout on PYTHONPATH or the
    # editable install would bring back the unmutated code).
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(workdir / "mutants")}
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)


def run(name: str, max_children: int) -> dict[str, Any]:
    target = TARGETS[name]
    with tempfile.TemporaryDirectory(prefix=f"mutation-{name}-") as tmp:
        workdir = Path(tmp)
        _prepare(workdir, target)
        started = time.monotonic()
        cpu_before_s = _children_cpu_s()
        done = _mutmut(workdir, "run", "--max-children", str(max_children))
        elapsed_s = time.monotonic() - started
        cpu_s = _children_cpu_s() - cpu_before_s
        if done.returncode != 0:
            raise SystemExit(
                f"mutmut run failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-3000:]}"
            )
        statuses: dict[str, int] = {}
        survivors = []
        for line in _mutmut(workdir, "results", "--all", "true").stdout.splitlines():
            mutant, _, status = line.strip().partition(": ")
            if not status:
                continue
            statuses[status] = statuses.get(status, 0) + 1
            if status != "killed":
                diff = _mutmut(workdir, "show", mutant).stdout
                survivors.append({"mutant": mutant, "status": status, "diff": diff})
    summary: dict[str, Any] = {
        "module": target.source,
        "tests": list(target.tests),
        "elapsed_s": round(elapsed_s, 1),
        # mutmut and every test process it forked and waited for, user and system.
        "cpu_s": round(cpu_s, 1),
        "stats": {"mutants": sum(statuses.values()), **statuses},
        "survivors": survivors,
    }
    results = _load_results()
    results[name] = summary
    RESULTS_JSON.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"{name}: {json.dumps(summary['stats'])} in {elapsed_s:.0f} s ({cpu_s:.0f} s CPU)")
    return summary


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _load_results() -> dict[str, dict[str, Any]]:
    if not RESULTS_JSON.exists():
        return {}
    results: dict[str, dict[str, Any]] = json.loads(RESULTS_JSON.read_text(encoding="utf-8"))
    return results


def _changed_lines(diff: str) -> str:
    """The mutant's lines of a unified diff, for one table cell."""
    lines = [
        line[1:].strip()
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    return " / ".join(lines).replace("|", "\\|")


def render_report() -> list[str]:
    """Write mutation.md from mutation.json and the reasons file; return unexplained survivors."""
    results = _load_results()
    reasons: dict[str, dict[str, str]] = tomllib.loads(REASONS.read_text(encoding="utf-8"))
    statuses = sorted({s for r in results.values() for s in r["stats"] if s != "mutants"})
    out = [
        "# Mutation testing",
        "",
        "Made by `bench/mutation.py` (mutmut 3, each target with only the tests listed; a",
        "mutant is killed when one of them fails). Every mutant that is not killed is listed",
        "below with why it is harmless; the reasons live in `bench/mutation_survivors.toml`.",
        "",
        "| target | module | tests | mutants | "
        + " | ".join(statuses)
        + " | wall (s) | CPU (s) |",
        "|---|---|---|---:|" + "---:|" * len(statuses) + "---:|---:|",
    ]
    for name, result in results.items():
        stats: dict[str, int] = result["stats"]
        tests = ", ".join(f"`{Path(t).name}`" for t in result["tests"])
        counts = " | ".join(str(stats.get(s, 0)) for s in statuses)
        out.append(
            f"| {name} | `{result['module']}` | {tests} | {stats['mutants']} | {counts} "
            f"| {result['elapsed_s']:.0f} | {result['cpu_s']:.0f} |"
        )
    unexplained = []
    for name, result in results.items():
        survivors: list[dict[str, str]] = result["survivors"]
        if not survivors:
            continue
        out += ["", f"## {name}: survivors", "", "| mutant | status | mutated to | why harmless |"]
        out.append("|---|---|---|---|")
        for survivor in survivors:
            mutant = survivor["mutant"]
            reason = reasons.get(name, {}).get(mutant)
            if reason is None:
                unexplained.append(mutant)
                reason = "**not explained yet**"
            short = mutant.rpartition(".")[2]
            changed = _changed_lines(survivor["diff"])
            out.append(f"| `{short}` | {survivor['status']} | `{changed}` | {reason} |")
    RESULTS_MD.write_text("\n".join(out) + "\n", encoding="utf-8")
    return unexplained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"any of {', '.join(TARGETS)}")
    parser.add_argument("--all", action="store_true", help="run every target")
    parser.add_argument("--list", action="store_true", help="print the target -> tests map")
    parser.add_argument("--report", action="store_true", help="only re-render mutation.md")
    parser.add_argument("--max-children", type=int, default=2, help="parallel test runs")
    args = parser.parse_args()
    names = list(TARGETS) if args.all else args.targets
    if args.list or not (names or args.report):
        for name, target in TARGETS.items():
            print(f"{name}: {target.source} <- {' '.join(target.tests)}")
        return
    unknown = set(names) - set(TARGETS)
    if unknown:
        parser.error(f"unknown target(s) {', '.join(sorted(unknown))}; use {', '.join(TARGETS)}")
    for name in names:
        run(name, args.max_children)
    unexplained = render_report()
    print(f"wrote {RESULTS_MD.relative_to(ROOT)}")
    if unexplained:
        print(f"{len(unexplained)} survivor(s) without a reason in {REASONS.name}:")
        print("\n".join(f"  {m}" for m in unexplained))


if __name__ == "__main__":
    main()
