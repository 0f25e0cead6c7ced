"""How many real trials the probe's search needs, next to two classic baselines.

For every preset of the zoo, several capacities of the emulated GPU and both checkpointing modes,
this runs the probe's search (`autotune.core.search.micro_batch.find_max_micro_batch`), plain
bisection over [1, cap] and doubling-then-bisection (Lightning's `power` then `binsearch`) on the
*same* fits function: real training steps on the emulated GPU, memoised per micro-batch so every
algorithm sees identical outcomes and each distinct size costs one real step. It checks that all
three agree on the answer and writes bench/results/probe_trials.{json,md}.

    .venv/bin/python bench/probe_trials.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from autotune.core.presets import PRESETS
from autotune.core.schemas import Spec
from autotune.core.search.micro_batch import StepOutcome, find_max_micro_batch
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.runner import InProcessRunner

RESULTS = Path(__file__).resolve().parent / "results"
CAP = 1024
# Short sequences keep the big presets affordable on a 2-core CPU; the search is shape-agnostic.
SEQ_LEN = {"gpt2-small": 16, "llama-small": 16, "gpt2-mini": 32, "llama-mini": 32}
# Capacities aimed at these max micro-batches, from the per-sample slope between b=8 and b=16
# (at b=2..3 the optimizer step can dominate the peak, which has no slope in b).
TARGET_MAX = (4, 16, 48)


def spec_for(name: str) -> Spec:
    training: dict[str, object] = {"max_micro_batch": CAP}
    if PRESETS[name].kind == "decoder":
        training["seq_len"] = SEQ_LEN.get(name, 64)
    return Spec.model_validate({"model": {"preset": name}, "training": training})


def plain_bisection(fits: Callable[[int], bool], cap: int) -> int:
    lo, hi = 0, cap + 1  # lo fits (0 trivially), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def doubling_then_bisection(fits: Callable[[int], bool], cap: int) -> int:
    lo, b = 0, 1
    while b <= cap and fits(b):
        lo, b = b, b * 2
    hi = min(b, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class MemoisedTrials:
    """Real trials at each micro-batch, run once and replayed; counts what each caller asks."""

    def __init__(self, session: InProcessRunner, checkpointing: bool) -> None:
        self.session = session
        self.checkpointing = checkpointing
        self.cache: dict[int, StepOutcome] = {}
        self.asked: set[int] = set()

    def observe(self, micro_batch: int) -> StepOutcome:
        self.asked.add(micro_batch)
        if micro_batch not in self.cache:
            self.cache[micro_batch] = self.session.trial(
                micro_batch, checkpointing=self.checkpointing
            )
        return self.cache[micro_batch]

    def fits(self, micro_batch: int) -> bool:
        return self.observe(micro_batch).fits

    def count(
        self, search: Callable[[Callable[[int], bool], int], int], cap: int
    ) -> tuple[int, int]:
        """Run a bool-only search on these trials; its answer and how many sizes it asked."""
        self.asked = set()
        answer = search(self.fits, cap)
        return answer, len(self.asked)


def capacity_for(spec: Spec, target_max: int) -> int:
    session = InProcessRunner(spec, EmulatedDevice(1 << 40))
    assert session.warm_up().fits
    peak8 = session.trial(8).peak_bytes
    per_sample_bytes = (session.trial(16).peak_bytes - peak8) / 8
    # Where the optimizer step dominates small micro-batches, extrapolating down from b=8 can
    # land below what b=1 needs: never go below a measured small step.
    floor_bytes = session.trial(min(target_max, 8)).peak_bytes
    return int(max(peak8 + (target_max - 8 + 0.5) * per_sample_bytes, floor_bytes))


def bench_case(spec: Spec, capacity_bytes: int) -> list[dict[str, object]]:
    session = InProcessRunner(spec, EmulatedDevice(capacity_bytes))
    assert session.warm_up().fits
    rows: list[dict[str, object]] = []
    known_fitting = 0
    for checkpointing in (False, True):
        trials = MemoisedTrials(session, checkpointing)
        started = time.perf_counter()
        ours = find_max_micro_batch(
            trials.observe, cap=CAP, capacity_bytes=capacity_bytes, known_fitting=known_fitting
        )
        ours_s = time.perf_counter() - started
        ours_trials = len(ours.attempts)
        bisect_answer, bisect_trials = trials.count(plain_bisection, CAP)
        doubling_answer, doubling_trials = trials.count(doubling_then_bisection, CAP)
        if not ours.max_micro_batch == bisect_answer == doubling_answer:
            raise AssertionError(
                f"disagreement: ours {ours.max_micro_batch}, bisection {bisect_answer}, "
                f"doubling {doubling_answer}"
            )
        rows.append(
            {
                "checkpointing": checkpointing,
                "max_micro_batch": ours.max_micro_batch,
                "trials": ours_trials,
                "sizes_tried": [a.micro_batch for a in ours.attempts],
                "bisection_trials": bisect_trials,
                "doubling_trials": doubling_trials,
                "bound": math.ceil(math.log2(CAP)) + 2,
                "search_s": round(ours_s, 2),
            }
        )
        known_fitting = ours.max_micro_batch
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny presets, one capacity")
    args = parser.parse_args()
    names = ["gpt2-tiny", "mlp"] if args.quick else sorted(PRESETS)
    targets = TARGET_MAX[:1] if args.quick else TARGET_MAX
    torch.manual_seed(0)

    cases: list[dict[str, object]] = []
    for name in names:
        spec = spec_for(name)
        for target_max in targets:
            capacity_bytes = capacity_for(spec, target_max)
            for row in bench_case(spec, capacity_bytes):
                row = {"preset": name, "capacity_bytes": capacity_bytes, **row}
                cases.append(row)
                print(
                    f"{name:12} cap {capacity_bytes / 2**20:9.1f} MiB "
                    f"ckpt {row['checkpointing']!s:5} max {row['max_micro_batch']:4}  "
                    f"ours {row['trials']:2} {row['sizes_tried']}  "
                    f"bisection {row['bisection_trials']:2}  doubling {row['doubling_trials']:2}",
                    flush=True,
                )

    def summary(key: str) -> dict[str, float]:
        values = [int(str(case[key])) for case in cases]
        return {
            "median": statistics.median(values),
            "max": max(values),
            "mean": statistics.fmean(values),
        }

    summaries = {
        "ours": summary("trials"),
        "plain_bisection": summary("bisection_trials"),
        "doubling_then_bisection": summary("doubling_trials"),
    }
    report = {
        "machine": f"{platform.machine()}, {platform.python_version()}, torch {torch.__version__}",
        "cap": CAP,
        "summary": summaries,
        "cases": cases,
    }
    RESULTS.mkdir(exist_ok=True)
    suffix = "_quick" if args.quick else ""
    (RESULTS / f"probe_trials{suffix}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Real trials per probe (emulated GPU, search cap 1024)",
        "",
        f"{report['machine']}. Produced by `bench/probe_trials.py`.",
        "",
        "| algorithm | median | mean | max |",
        "|---|---|---|---|",
    ]
    for algorithm, stats in summaries.items():
        lines.append(f"| {algorithm} | {stats['median']} | {stats['mean']:.2f} | {stats['max']} |")
    lines += [
        "",
        "| preset | capacity MiB | checkpointing | max | ours | sizes tried | bisection "
        "| doubling |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        lines.append(
            f"| {case['preset']} | {int(str(case['capacity_bytes'])) / 2**20:.1f} | "
            f"{case['checkpointing']} | {case['max_micro_batch']} | {case['trials']} | "
            f"{case['sizes_tried']} | {case['bisection_trials']} | {case['doubling_trials']} |"
        )
    (RESULTS / f"probe_trials{suffix}.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
