"""What "what would make it fit" costs: the traced steps behind each remedy, and their seconds.

Runs `autotune.engine.remedy_trials.find_fit_advice` on a spec that fits nowhere on a named GPU
(default: full fine-tuning of Llama-3-8B, `examples/llama-3-8b-full.yaml`, on an RTX 4090) in
this process, and counts per remedy (from the moment it is announced to the next one): the
estimate runners built (each builds the model on fake tensors), the warm-up steps and trials
traced, and the CPU and wall seconds. The machine's load average is recorded beside them: the
box is shared, so CPU seconds are the figure to compare.

    .venv/bin/python bench/fit_advice.py [--spec FILE] [--gpu NAME] [--label before|after]

`--label` files the figures under that label in bench/results/fit_advice.{json,md}, keeping the
other labels' (run the "before" label on the commit before the change).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from autotune.core.schemas import Spec
from autotune.engine import estimate
from autotune.engine.remedy_trials import SameGpu, find_fit_advice

RESULTS = Path(__file__).resolve().parent / "results"


class _Counts:
    """Runner builds, warm-ups and trials, and CPU/wall seconds, per announced remedy."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.start("(setup)")

    def start(self, label: str) -> None:
        self._close()
        self.rows.append({"remedy": label, "builds": 0, "warm_ups": 0, "trials": 0})
        self._cpu_s, self._wall_s = time.process_time(), time.monotonic()

    def _close(self) -> None:
        if self.rows:
            row = self.rows[-1]
            row["cpu_s"] = round(time.process_time() - self._cpu_s, 1)
            row["wall_s"] = round(time.monotonic() - self._wall_s, 1)

    def finish(self) -> None:
        self._close()

    def count(self, key: str) -> None:
        self.rows[-1][key] += 1


def _counting(counts: _Counts) -> None:
    """Wrap `EstimateRunner`'s constructor, warm-up and trial to count them."""
    cls = estimate.EstimateRunner

    def wrap(name: str, key: str) -> None:
        original: Callable[..., Any] = getattr(cls, name)

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            counts.count(key)
            return original(self, *args, **kwargs)

        setattr(cls, name, counted)

    wrap("__init__", "builds")
    wrap("warm_up", "warm_ups")
    wrap("trial", "trials")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="examples/llama-3-8b-full.yaml")
    parser.add_argument("--gpu", default="RTX 4090")
    parser.add_argument("--label", default="after")
    args = parser.parse_args()
    spec = Spec.model_validate(yaml.safe_load(Path(args.spec).read_text()))
    counts = _Counts()
    _counting(counts)
    load_before = os.getloadavg()
    cpu_s, wall_s = time.process_time(), time.monotonic()
    advice = find_fit_advice(spec, SameGpu(args.gpu, 0), on_change=counts.start)
    counts.finish()
    result = {
        "spec": args.spec,
        "gpu": args.gpu,
        "cpu_s": round(time.process_time() - cpu_s, 1),
        "wall_s": round(time.monotonic() - wall_s, 1),
        "load_average_before": [round(x, 1) for x in load_before],
        "load_average_after": [round(x, 1) for x in os.getloadavg()],
        "remedies": [r.change for r in advice.remedies],
        "still_too_large": advice.still_too_large,
        "per_remedy": counts.rows,
        "totals": {
            key: sum(row[key] for row in counts.rows) for key in ("builds", "warm_ups", "trials")
        },
    }
    print(json.dumps(result, indent=2))
    path = RESULTS / "fit_advice.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    stored[args.label] = result
    path.write_text(json.dumps(stored, indent=2) + "\n")
    (RESULTS / "fit_advice.md").write_text(_markdown(stored))


def _markdown(stored: dict[str, Any]) -> str:
    lines = [
        "# What would make it fit: traced steps and seconds",
        "",
        "`bench/fit_advice.py`: `find_fit_advice` in one process, counted per remedy (runners",
        "built, warm-ups and trials traced, CPU and wall seconds) on a shared 2-core box.",
    ]
    for label, result in stored.items():
        totals = result["totals"]
        lines += [
            "",
            f"## {label}: {result['spec']} on {result['gpu']}",
            "",
            f"{result['cpu_s']} CPU s, {result['wall_s']} s wall (load average "
            f"{result['load_average_before'][0]} before, {result['load_average_after'][0]} "
            f"after); {totals['builds']} runners built, {totals['warm_ups']} warm-ups, "
            f"{totals['trials']} trials.",
            f"Remedies: {', '.join(result['remedies']) or 'none'}.",
            "",
            "| remedy | runners | warm-ups | trials | CPU s | wall s |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {row['remedy']} | {row['builds']} | {row['warm_ups']} | {row['trials']} | "
            f"{row['cpu_s']} | {row['wall_s']} |"
            for row in result["per_remedy"]
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
