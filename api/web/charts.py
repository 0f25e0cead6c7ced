"""Scatter charts drawn on the server as SVG markup: the web pages' plots, with no script.

A chart is points (each one an SVG element of class `point`, with a `<title>` a screen reader
and a mouse both see), horizontal rules (capacity, headroom) and lines (a fitted model), on
labelled axes whose titles carry the unit. The x axis turns logarithmic (base 2) when it spans
16x or more: probe attempts double from 1 before they bisect, and a linear axis would crowd every
small micro-batch into its first pixels. Shapes, not only colours, tell kinds apart (a cross is
an out-of-memory attempt, a ring the chosen configuration, a square a traced prediction), so
the charts read in grey too.

Every value comes from a worker, and the drawing is total: any floats (subnormal, at the ends
of the range, integers beyond float precision) give a chart with a bounded number of ticks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

_WIDTH, _HEIGHT = 640, 360
_LEFT, _RIGHT, _TOP, _BOTTOM = 72, 150, 16, 52  # the right margin holds the legend
_LOG_SPAN = 16.0
_MAX_LOG_TICKS = 12
# Drawn values are kept within +-_LIMIT (spans stay finite) and spans above _MIN_SPAN (a power
# of ten below it is no float).
_LIMIT = 1e300
_MIN_SPAN = 1e-290
# Pixel positions are clamped this far outside the plot: a point the axes cannot reach is drawn
# at the edge, not at 10^300 px.
_MAX_PX = 10_000.0


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    title: str  # the tooltip and the accessible name: what the point is, in words
    marker: str = "dot"  # dot | cross (out of memory) | ring (chosen) | square (traced)
    data: dict[str, str] = field(default_factory=dict)  # data-* attributes (tests read them)
    label: str = ""  # a few characters printed beside the point


@dataclass(frozen=True)
class Series:
    name: str
    css_class: str  # colours live in the stylesheet
    points: Sequence[Point]


@dataclass(frozen=True)
class Rule:
    """A horizontal line across the plot at `y`, labelled at its right end."""

    y: float
    label: str
    css_class: str


@dataclass(frozen=True)
class Line:
    """A polyline through `xy` (already in data units), named in the legend."""

    name: str
    css_class: str
    xy: Sequence[tuple[float, float]]


@dataclass(frozen=True)
class Chart:
    title: str
    description: str
    x_label: str
    y_label: str
    series: Sequence[Series]
    rules: Sequence[Rule] = ()
    lines: Sequence[Line] = ()
    y_from_zero: bool = True


def _finite(value: float) -> float:
    """`value` within what the arithmetic below can hold (NaN as 0): the charts draw what
    workers reported, and a value at the ends of the float range must not end the page."""
    if math.isnan(value):
        return 0.0
    return min(max(value, -_LIMIT), _LIMIT)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 times a power of ten) covering [low, high]; total
    (any floats give at most 2 * count + 2 ticks)."""
    low, high = _finite(low), _finite(high)
    # A span too narrow for the floats at this height (a micro-batch of 2^51 with its
    # neighbour), or too small for a power of ten to name (subnormal rates), is widened.
    floor_span = max(abs(low), abs(high)) * 1e-9 + _MIN_SPAN
    if high <= low:
        high = low + max(1.0, floor_span)
    elif high - low < floor_span:
        high = low + floor_span
    count = max(count, 1)
    raw_step = (high - low) / count
    magnitude = 10.0 ** math.floor(math.log10(raw_step))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw_step)
    first = math.floor(low / step) * step
    intervals = min(math.ceil((high - first) / step - 1e-9), 2 * count + 1)
    ticks = [first + index * step for index in range(intervals + 1)]
    # Rounded to hide float noise (0.30000000000000004), unless the ticks are that small.
    return [round(tick, 12) for tick in ticks] if step >= 1e-9 else ticks


def _log2_ticks(low: float, high: float) -> list[float]:
    first, last = math.floor(math.log2(low)), math.ceil(math.log2(high))
    # At most about a dozen: every power of two up to 2^63 would crowd the axis.
    stride = max(1, math.ceil((last - first) / _MAX_LOG_TICKS))
    return [2.0**k for k in range(first, last + stride, stride)]


def _label(value: float) -> str:
    return f"{value:g}" if abs(value) < 1e6 else f"{value:.3g}"


class _Scale:
    def __init__(self, low: float, high: float, start_px: float, end_px: float, log: bool):
        self.log = log
        self.low, self.high = (math.log2(low), math.log2(high)) if log else (low, high)
        self.start_px, self.end_px = start_px, end_px

    def __call__(self, value: float) -> float:
        value = _finite(value)
        v = math.log2(value) if self.log and value > 0 else value
        span = self.high - self.low or 1.0
        px = self.start_px + (v - self.low) / span * (self.end_px - self.start_px)
        return min(max(px, -_MAX_PX), _MAX_PX) if math.isfinite(px) else self.start_px


def _marker(point: Point, x: float, y: float, css_class: str) -> str:
    data = "".join(f' data-{escape(k)}="{escape(v)}"' for k, v in point.data.items())
    title = f"<title>{escape(point.title)}</title>"
    classes = f"point {point.marker} {css_class}"
    if point.marker == "cross":
        d = f"M{x - 5:.1f},{y - 5:.1f}l10,10m-10,0l10,-10"
        return f'<path class="{classes}" d="{d}"{data}>{title}</path>'
    if point.marker == "square":
        corner = f'x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8"'
        return f'<rect class="{classes}" {corner}{data}>{title}</rect>'
    radius = 8 if point.marker == "ring" else 4
    return (
        f'<circle class="{classes}" cx="{x:.1f}" cy="{y:.1f}" r="{radius}"{data}>{title}</circle>'
    )


def render_svg(chart: Chart) -> str:
    """The chart as an inline `<svg>` element (role img, titled and described)."""
    xs = [p.x for s in chart.series for p in s.points] + [
        x for ln in chart.lines for x, _ in ln.xy
    ]
    ys = [p.y for s in chart.series for p in s.points] + [
        y for ln in chart.lines for _, y in ln.xy
    ]
    ys += [r.y for r in chart.rules]
    if not xs:
        xs, ys = [1.0, 2.0], ys or [0.0, 1.0]
    xs, ys = [_finite(x) for x in xs], [_finite(y) for y in ys]
    x_low, x_high = min(xs), max(xs)
    log_x = x_low > 0 and x_high / x_low >= _LOG_SPAN
    if log_x:
        x_ticks = _log2_ticks(x_low, x_high)
    else:
        x_ticks = nice_ticks(x_low if x_low != x_high else x_low - 1, x_high)
    y_ticks = nice_ticks(0.0 if chart.y_from_zero else min(ys), _finite(max(ys) * 1.05) or 1.0)
    plot_right, plot_bottom = _WIDTH - _RIGHT, _HEIGHT - _BOTTOM
    sx = _Scale(x_ticks[0], x_ticks[-1], _LEFT, plot_right, log_x)
    sy = _Scale(y_ticks[0], y_ticks[-1], plot_bottom, _TOP, False)
    ident = "".join(c if c.isalnum() else "-" for c in chart.title.lower())
    out = [
        f'<svg class="chart" viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" '
        f'aria-labelledby="{ident}-title {ident}-desc" data-log-x="{str(log_x).lower()}">',
        f'<title id="{ident}-title">{escape(chart.title)}</title>',
        f'<desc id="{ident}-desc">{escape(chart.description)}</desc>',
        '<g class="axes">',
        f'<line x1="{_LEFT}" y1="{plot_bottom}" x2="{plot_right}" y2="{plot_bottom}"/>',
        f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{plot_bottom}"/>',
    ]
    for tick in x_ticks:
        x = sx(tick)
        out.append(
            f'<line class="grid" x1="{x:.1f}" y1="{_TOP}" x2="{x:.1f}" y2="{plot_bottom}"/>'
        )
        out.append(
            f'<text class="tick" x="{x:.1f}" y="{plot_bottom + 16}" text-anchor="middle">'
            f"{_label(tick)}</text>"
        )
    for tick in y_ticks:
        y = sy(tick)
        out.append(
            f'<line class="grid" x1="{_LEFT}" y1="{y:.1f}" x2="{plot_right}" y2="{y:.1f}"/>'
        )
        out.append(
            f'<text class="tick" x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{_label(tick)}</text>"
        )
    x_title = chart.x_label + (" (log scale)" if log_x else "")
    out += [
        f'<text class="axis-title" x="{(_LEFT + plot_right) / 2:.0f}" y="{_HEIGHT - 12}" '
        f'text-anchor="middle">{escape(x_title)}</text>',
        f'<text class="axis-title" transform="translate(16 {(_TOP + plot_bottom) / 2:.0f}) '
        f'rotate(-90)" text-anchor="middle">{escape(chart.y_label)}</text>',
        "</g>",
    ]
    for index, rule in enumerate(chart.rules):
        y = sy(rule.y)
        # The first rule's label sits above its line, the others' below: capacity and the
        # headroom budget are a few pixels apart.
        label_y = y - 4 if index == 0 else y + 12
        out.append(
            f'<g class="rule {rule.css_class}"><line x1="{_LEFT}" y1="{y:.1f}" '
            f'x2="{plot_right}" y2="{y:.1f}"/><text x="{plot_right + 4}" y="{label_y:.1f}">'
            f"{escape(rule.label)}</text></g>"
        )
    for line in chart.lines:
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in line.xy)
        out.append(f'<polyline class="fit-line {line.css_class}" points="{path}"/>')
    for series in chart.series:
        out.append(f'<g class="series {series.css_class}" data-series="{escape(series.name)}">')
        out += [_marker(p, sx(p.x), sy(p.y), series.css_class) for p in series.points]
        out += [
            f'<text class="point-label" x="{sx(p.x) + 9:.1f}" y="{sy(p.y) - 7:.1f}">'
            f"{escape(p.label)}</text>"
            for p in series.points
            if p.label
        ]
        out.append("</g>")
    out.append(_legend(chart, plot_right + 12))
    out.append("</svg>")
    return "\n".join(out)


def _legend(chart: Chart, left: float) -> str:
    rows = [(s.name, s.css_class, "dot") for s in chart.series]
    markers = {p.marker for s in chart.series for p in s.points}
    if "cross" in markers:
        rows.append(("out of memory", "legend-oom", "cross"))
    if "ring" in markers:
        rows.append(("chosen", "legend-chosen", "ring"))
    if "square" in markers:
        rows.append(("traced, not run", "legend-traced", "square"))
    rows += [(ln.name, ln.css_class, "line") for ln in chart.lines]
    out = ['<g class="legend">']
    # At the bottom of the right margin: the rules' labels (capacity, headroom) sit at its top.
    top = _HEIGHT - _BOTTOM - 18 * (len(rows) - 1)
    for i, (name, css_class, marker) in enumerate(rows):
        y = top + i * 18
        if marker == "line":
            ends = f'x1="{left}" y1="{y}" x2="{left + 12}" y2="{y}"'
            shape = f'<line class="fit-line {css_class}" {ends}/>'
        else:
            shape = _marker(Point(left + 6, y, name, marker), left + 6, y, css_class)
            shape = shape.replace('class="point ', 'class="key ')
        out.append(f'{shape}<text x="{left + 18}" y="{y + 4}">{escape(name)}</text>')
    out.append("</g>")
    return "".join(out)
