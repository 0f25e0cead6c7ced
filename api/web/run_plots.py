"""A run's plots: peak memory against micro-batch, and samples/s against micro-batch.

The memory plot has every probe attempt of the run's latest claim as a point (fits as dots,
out-of-memory as crosses) for both checkpointing modes, the points a trace predicted without
running (squares; they gave the search its first guess), the capacity a step may use, the
headroom's budget below it, and per mode the least-squares line through the fits and traces:
a step's memory is close to affine in the micro-batch (weights, gradients and optimizer state,
plus activations per sample), so the line shows how far the next micro-batch is from the wall.
The throughput plot has every measured trial, its accumulation steps in its title, and the
recommended configuration ringed. With sharding: auto a third plot has each layout's best
samples/s per GPU.
"""

from __future__ import annotations

from api.store.rowmodels import target_memory_bytes
from api.web.charts import Chart, Line, Point, Rule, Series
from autotune.core.schemas import LayoutVerdict, TrialState
from autotune.remote.protocol import Run

_GIB = 2**30
_MIB = 2**20


def _unit(max_bytes: float) -> tuple[float, str]:
    return (_GIB, "GiB") if max_bytes >= _GIB else (_MIB, "MiB")


def capacity_bytes(run: Run) -> int:
    """What a step may use: the worker's measured capacity, else the target's memory."""
    if run.worker_device is not None:
        return run.worker_device.capacity_bytes
    if run.recommendation is not None:
        return run.recommendation.capacity_bytes
    return target_memory_bytes(run.device)


def latest_attempts(run: Run) -> list[tuple[bool, int, int, bool]]:
    """(checkpointing, micro_batch, peak_bytes, fits) of every attempt of the latest claim."""
    return [
        (a.checkpointing, a.attempt.micro_batch, a.attempt.peak_bytes, a.attempt.fits)
        for a in run.attempts
        if a.claim_number == run.claim_count
    ]


def _least_squares(xy: list[tuple[int, int]]) -> tuple[float, float] | None:
    """(intercept, slope) of y on x, or None with fewer than two distinct x."""
    if len({x for x, _ in xy}) < 2:
        return None
    n = len(xy)
    mean_x = sum(x for x, _ in xy) / n
    mean_y = sum(y for _, y in xy) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in xy) / sum((x - mean_x) ** 2 for x, _ in xy)
    return mean_y - slope * mean_x, slope


def traced_points(run: Run) -> dict[bool, list[tuple[int, int]]]:
    """Per mode, the (micro_batch, peak_bytes) a trace without a run predicted (on fake tensors),
    which gave the search its first guess (`ModeProbe.traced`)."""
    return {
        mode.checkpointing: [(p.micro_batch, p.peak_bytes) for p in mode.traced.fit_points]
        for mode in run.modes
        if mode.traced is not None
    }


def _dip_marks(
    run: Run, checkpointing: bool, name: str, css: str, capacity: int, scale: float, unit: str
) -> list[Point]:
    """The sizes below a mode's max that run out (`ModeProbe.runs_out_below`: memory is not
    monotone in the micro-batch), marked as dips at the capacity line, which they cross."""
    mode = next((m for m in run.modes if m.checkpointing == checkpointing), None)
    if mode is None:
        return []
    return [
        Point(
            x=b,
            y=capacity / scale,
            title=f"{name}, micro-batch {b}: runs out, below {mode.max_micro_batch}, which fits "
            "(a dip: keep every batch at the chosen size)",
            marker="cross",
            data={"mode": css, "dip": "true", "micro-batch": str(b)},
            label="dip",
        )
        for b in mode.runs_out_below
    ]


def memory_chart(run: Run) -> Chart:
    attempts = latest_attempts(run)
    traced = traced_points(run)
    capacity = capacity_bytes(run)
    peaks = [peak for _, _, peak, _ in attempts] + [p for t in traced.values() for _, p in t]
    scale, unit = _unit(max([capacity, *peaks]))
    series, lines = [], []
    for checkpointing, name, css in ((False, "plain", "plain"), (True, "checkpointed", "ckpt")):
        mode = [(b, peak, fits) for c, b, peak, fits in attempts if c == checkpointing]
        predicted = traced.get(checkpointing, [])
        points = [
            Point(
                x=b,
                y=peak / scale,
                title=f"{name}, micro-batch {b}: {peak / scale:.2f} {unit} traced (not run)",
                marker="square",
                data={"mode": css, "traced": "true", "micro-batch": str(b)},
            )
            for b, peak in predicted
        ] + [
            Point(
                x=b,
                y=peak / scale,
                title=f"{name}, micro-batch {b}: {peak / scale:.2f} {unit}, "
                + ("fits" if fits else "out of memory"),
                marker="dot" if fits else "cross",
                data={"mode": css, "fits": str(fits).lower(), "micro-batch": str(b)},
            )
            for b, peak, fits in mode
        ]
        points += _dip_marks(run, checkpointing, name, css, capacity, scale, unit)
        series.append(Series(name=f"{name} (fits)", css_class=css, points=points))
        fit = _least_squares([(b, peak) for b, peak, fits in mode if fits] + predicted)
        if fit is not None:
            sizes = [b for b, _, _ in mode] + [b for b, _ in predicted]
            low, high = min(sizes), max(sizes)
            steps = [low + (high - low) * i / 32 for i in range(33)]
            xy = [(x, (fit[0] + fit[1] * x) / scale) for x in steps]
            lines.append(Line(name=f"{name} fitted", css_class=css, xy=xy))
    headroom = run.spec.training.headroom
    rules = [Rule(y=capacity / scale, label="capacity", css_class="capacity")]
    if headroom > 0:
        rules.append(
            Rule(
                y=capacity * (1 - headroom) / scale,
                label=f"headroom {headroom:.0%}",
                css_class="headroom",
            )
        )
    return Chart(
        title="Peak memory against micro-batch",
        description=f"{len(attempts)} probe attempts in two checkpointing modes, against a "
        f"capacity of {capacity / scale:.2f} {unit}, and the line through each mode's fits "
        "and traced points.",
        x_label="micro-batch (samples)",
        y_label=f"peak memory ({unit})",
        series=series,
        rules=rules,
        lines=lines,
    )


def throughput_chart(run: Run) -> Chart:
    chosen = run.recommendation
    trials = [
        t.trial
        for t in run.trials
        if t.claim_number == run.claim_count
        and t.trial.state is TrialState.COMPLETE
        and t.trial.samples_per_s is not None
    ]
    series = []
    for checkpointing, name, css in ((False, "plain", "plain"), (True, "checkpointed", "ckpt")):
        points = []
        for trial in (t for t in trials if t.checkpointing == checkpointing):
            is_chosen = chosen is not None and (
                trial.micro_batch,
                trial.accumulation_steps,
                trial.checkpointing,
                trial.checkpointed_blocks,
            ) == (
                chosen.micro_batch,
                chosen.accumulation_steps,
                chosen.checkpointing,
                chosen.checkpointed_blocks,
            )
            assert trial.samples_per_s is not None
            points.append(
                Point(
                    x=trial.micro_batch,
                    y=trial.samples_per_s,
                    title=f"trial {trial.number}: micro-batch {trial.micro_batch} x "
                    f"{trial.accumulation_steps} accumulation steps, checkpointing "
                    f"{trial.checkpointing_label}: {trial.samples_per_s:.1f} samples/s"
                    + (" (chosen)" if is_chosen else ""),
                    marker="ring" if is_chosen else "dot",
                    label=f"×{trial.accumulation_steps}",
                    data={
                        "mode": css,
                        "accumulation": str(trial.accumulation_steps),
                        "chosen": str(is_chosen).lower(),
                    },
                )
            )
        series.append(Series(name=name, css_class=css, points=points))
    return Chart(
        title="Throughput against micro-batch",
        description=f"{len(trials)} measured trials; each point's accumulation steps make "
        "up the target global batch.",
        x_label="micro-batch (samples)",
        y_label=f"throughput (samples/s per GPU, {run.speed_label})",
        series=series,
    )


def layouts_chart(run: Run) -> Chart:
    """sharding: auto: each layout's best samples/s per GPU, in the order the tuner lists them
    (the chosen one first, ringed); a layout with no speed (it does not fit, or hits no
    target) is a cross at zero."""
    world = run.spec.training.world_size
    points = []
    for index, layout in enumerate(run.layouts, start=1):
        rec = layout.recommendation
        name = layout.sharding.value
        chosen = layout.verdict is LayoutVerdict.CHOSEN
        if rec is None:
            title = f"{name}: {layout.reason}"
            points.append(
                Point(x=index, y=0.0, title=title, marker="cross", label=name,
                      data={"layout": name, "chosen": "false"})
            )  # fmt: skip
            continue
        title = (
            f"{name}: {rec.samples_per_s:.2f} samples/s per GPU, "
            f"{rec.job_samples_per_s:.1f} for the job of {world} GPUs"
            + (" (chosen)" if chosen else "")
        )
        points.append(
            Point(x=index, y=rec.samples_per_s, title=title, marker="ring" if chosen else "dot",
                  label=name, data={"layout": name, "chosen": str(chosen).lower()})
        )  # fmt: skip
    return Chart(
        title="Throughput per layout",
        description=f"{len(run.layouts)} layouts, the chosen one first: each one's best "
        f"configuration's samples/s per GPU (times {world} for the job).",
        x_label="layout (in the order of the table)",
        y_label=f"samples/s per GPU ({run.speed_label})",
        series=[Series(name="layouts", css_class="plain", points=points)],
    )
