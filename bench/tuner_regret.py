"""The tuner's pick against the exhaustive grid, on the emulated GPU.

For several presets this runs `tune` (probe, accumulation limits, prior-ordered Optuna study with
its default budget), then measures *every* candidate of the same grid the same way (same
session, same kernel, same timing) and reports:

- samples/s ratio: the grid's measurement of the tuner's pick / the grid's best (goal >= 0.98);
- wall time ratio: the time the tuner spent measuring / the time the grid spent (goal <= 0.3).
  Both searches need the same probe first; its time is reported apart.

Writes bench/results/tuner_regret.{json,md}.

    .venv/bin/python bench/tuner_regret.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from autotune.core.schemas import Spec, TrialState
from autotune.core.tuning.candidates import Candidate, enumerate_candidates
from autotune.core.tuning.throughput import Measurement
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.runner import ForwardingRunner, InProcessRunner, TrialRunner
from autotune.engine.tuner import tune_session

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 2**20
# (preset, training settings, emulated capacity): capacities where the plain mode fits a
# mid-sized micro-batch, so both checkpointing modes and several accumulations compete.
CASES: list[tuple[str, dict[str, object], int]] = [
    ("gpt2-tiny", {"seq_len": 64, "target_global_batch": 64}, 200 * MiB),
    ("llama-tiny", {"seq_len": 64, "target_global_batch": 64}, 220 * MiB),
    ("cnn", {"input_shape": [3, 32, 32], "target_global_batch": 256}, 40 * MiB),
    ("mlp", {"target_global_batch": 1024}, 64 * MiB),
]
SECONDS_PER_TRIAL = 1.0


class TimedRunner(ForwardingRunner):
    """Forwards to a runner and adds up the time spent in measurements."""

    def __init__(self, runner: TrialRunner) -> None:
        super().__init__(runner)
        self.measure_s = 0.0
        self.measured: list[tuple[int, int, bool]] = []

    def measure(
        self,
        micro_batch: int,
        accumulation_steps: int,
        *,
        checkpointing: bool,
        target_seconds: float,
        checkpointed_blocks: int | None = None,
    ) -> Measurement | None:
        started = time.perf_counter()
        try:
            return super().measure(
                micro_batch,
                accumulation_steps,
                checkpointing=checkpointing,
                target_seconds=target_seconds,
                checkpointed_blocks=checkpointed_blocks,
            )
        finally:
            self.measure_s += time.perf_counter() - started
            self.measured.append((micro_batch, accumulation_steps, checkpointing))


def bench_case(name: str, training: dict[str, object], capacity_bytes: int) -> dict[str, object]:
    spec = Spec.model_validate({"model": {"preset": name}, "training": training})
    runner = TimedRunner(InProcessRunner(spec, EmulatedDevice(capacity_bytes)))
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        result = tune_session(
            runner,
            storage_url=f"sqlite:///{scratch}/optuna.db",
            target_seconds=SECONDS_PER_TRIAL,
        )
        tune_s = time.perf_counter() - started
    tuner_measure_s = runner.measure_s
    rec = result.recommendation
    assert rec is not None, result.infeasible

    # The same grid the tuner searched: exact candidates under each mode's limits.
    target = spec.training.target_global_batch
    assert target is not None
    limits = {m.checkpointing: m.recommended_micro_batch for m in result.probe.modes}
    accumulating = {m.checkpointing: m.accumulating_micro_batch for m in result.probe.modes}
    grid = [
        c
        for c in enumerate_candidates(target, spec.training.world_size, limits)
        if c.accumulation_steps == 1 or c.micro_batch <= (accumulating[c.checkpointing] or 0)
    ]
    runner.measure_s = 0.0
    measured: dict[Candidate, float] = {}
    for candidate in grid:
        measurement = runner.measure(
            candidate.micro_batch,
            candidate.accumulation_steps,
            checkpointing=candidate.checkpointing,
            target_seconds=SECONDS_PER_TRIAL,
        )
        measured[candidate] = measurement.samples_per_s if measurement else 0.0
    grid_measure_s = runner.measure_s
    best = max(measured, key=measured.__getitem__)
    pick = Candidate(rec.micro_batch, rec.accumulation_steps, rec.checkpointing)
    tuner_trials = [t for t in result.trials if t.state is TrialState.COMPLETE]
    return {
        "preset": name,
        "training": training,
        "capacity_bytes": capacity_bytes,
        "grid_size": len(grid),
        "tuner_trials": len(result.trials),
        "tuner_complete_trials": len(tuner_trials),
        "tuner_pick": [pick.micro_batch, pick.accumulation_steps, pick.checkpointing],
        "grid_best": [best.micro_batch, best.accumulation_steps, best.checkpointing],
        "pick_samples_per_s_in_grid": round(measured[pick], 2),
        "best_samples_per_s_in_grid": round(measured[best], 2),
        "samples_per_s_ratio": round(measured[pick] / measured[best], 4),
        "tuner_measure_s": round(tuner_measure_s, 2),
        "grid_measure_s": round(grid_measure_s, 2),
        "wall_time_ratio": round(tuner_measure_s / grid_measure_s, 4),
        "tune_total_s": round(tune_s, 2),
        "grid": {
            f"b={c.micro_batch} G={c.accumulation_steps} ckpt={c.checkpointing}": round(v, 2)
            for c, v in measured.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one preset")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, training, capacity_bytes in CASES[:1] if args.quick else CASES:
        row = bench_case(name, training, capacity_bytes)
        rows.append(row)
        print(
            f"{name:10} grid {row['grid_size']:3} tuner trials {row['tuner_trials']:2}  "
            f"pick {row['tuner_pick']} best {row['grid_best']}  "
            f"samples/s ratio {row['samples_per_s_ratio']:.3f}  "
            f"wall ratio {row['wall_time_ratio']:.3f}",
            flush=True,
        )
    ratios = [float(str(r["samples_per_s_ratio"])) for r in rows]
    walls = [float(str(r["wall_time_ratio"])) for r in rows]
    summary = {
        "samples_per_s_ratio": {"min": min(ratios), "median": statistics.median(ratios)},
        "wall_time_ratio": {"max": max(walls), "median": statistics.median(walls)},
        "goals": {"samples_per_s_ratio_min": 0.98, "wall_time_ratio_max": 0.3},
    }
    report = {
        "machine": f"{platform.machine()}, {platform.python_version()}, torch {torch.__version__}",
        "seconds_per_trial": SECONDS_PER_TRIAL,
        "summary": summary,
        "cases": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    suffix = "_quick" if args.quick else ""
    (RESULTS / f"tuner_regret{suffix}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Tuner pick vs exhaustive grid (emulated GPU)",
        "",
        f"{report['machine']}; {SECONDS_PER_TRIAL} s of timed steps per measurement. "
        "Produced by `bench/tuner_regret.py`.",
        "",
        "| preset | grid | tuner trials | pick (b, G, ckpt) | grid best | samples/s ratio "
        "| wall time ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['grid_size']} | {r['tuner_trials']} | {r['tuner_pick']} | "
            f"{r['grid_best']} | {r['samples_per_s_ratio']} | {r['wall_time_ratio']} |"
        )
    lines += ["", f"Summary: `{json.dumps(summary)}`"]
    (RESULTS / f"tuner_regret{suffix}.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
