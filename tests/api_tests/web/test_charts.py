"""`api.web.charts` is total: any floats a worker reported draw a chart, with a bounded number
of ticks, in bounded time (issue 25, item 5: a micro-batch of 2^51 looped forever in
`nice_ticks`; samples/s of 5e-324 or 1.7e308 raised)."""

from __future__ import annotations

import math
import re
import threading

import pytest

from api.web.charts import Chart, Point, Rule, Series, nice_ticks, render_svg

EXTREMES = [0.0, 5e-324, 1e-300, 1.0, 2.0**51, 2.0**51 + 1, 2.0**63, 1.7e308, math.inf, math.nan]


def _finishes(call: object, timeout_s: float = 10.0) -> object:
    """`call()` in a thread; fails (instead of hanging the suite) if it does not return."""
    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(call()), daemon=True)  # type: ignore[operator]
    thread.start()
    thread.join(timeout_s)
    assert results, f"still running after {timeout_s} s"
    return results[0]


@pytest.mark.parametrize("low", EXTREMES)
@pytest.mark.parametrize("high", EXTREMES)
def test_nice_ticks_is_total(low: float, high: float) -> None:
    ticks = _finishes(lambda: nice_ticks(low, high))
    assert isinstance(ticks, list)
    assert 2 <= len(ticks) <= 12
    assert all(math.isfinite(t) for t in ticks)
    assert ticks == sorted(ticks)


@pytest.mark.parametrize(
    ("xs", "ys"),
    [
        ([2**51, 2**51 + 1], [1.0, 2.0]),
        ([1, 2], [5e-324, 5e-324]),
        ([1, 2], [1.7e308, 1.7e308]),
        ([1, 2**63 - 1], [0.0, 1.7e308]),
    ],
)
def test_charts_of_extreme_values_render(xs: list[float], ys: list[float]) -> None:
    points = [Point(x, y, f"{x} {y}") for x, y in zip(xs, ys, strict=True)]
    chart = Chart(
        title="t",
        description="d",
        x_label="micro-batch",
        y_label="samples/s",
        series=[Series("s", "s", points)],
        rules=[Rule(max(ys), "capacity", "capacity")],
    )
    svg = _finishes(lambda: render_svg(chart))
    assert isinstance(svg, str)
    assert svg.count('class="tick"') <= 30
    # Every coordinate is a short finite number.
    for number in re.findall(r'\s(?:x|y|cx|cy|x1|x2|y1|y2)="([^"]*)"', svg):
        assert len(number) < 12 and math.isfinite(float(number)), number
