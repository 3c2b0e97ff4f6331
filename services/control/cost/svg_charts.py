"""Two small charts drawn as inline SVG strings, for pages that must work offline: lines over an
x axis (``line_chart``) and bars on rows over time (``timeline_chart``). Pure: data in, markup out.

Every text that goes into the markup is escaped here, so callers pass plain strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

AXIS_COLOR = "#888888"
TEXT_COLOR = "#333333"
MARK_COLOR = "#d7191c"  # a timeline bar's marker (a preemption)
_MARGIN_LEFT, _MARGIN_RIGHT, _MARGIN_TOP, _MARGIN_BOTTOM = 70, 20, 16, 44
_LEGEND_ROW = 16


@dataclass(frozen=True)
class Series:
    """One line of a ``line_chart``: ``points`` are (x, y) in data units, in x order."""

    name: str
    points: Sequence[tuple[float, float]]
    color: str
    dash: str | None = None  # an SVG stroke-dasharray, e.g. "6 4"
    markers: bool = False  # a dot on every point


@dataclass(frozen=True)
class Bar:
    """One bar of a ``timeline_chart``: ``row`` from ``start`` to ``end`` (data units)."""

    row: str
    start: float
    end: float
    color: str
    kind: str  # a CSS class naming what the bar is (e.g. its capacity type)
    title: str  # shown on hover
    marked: bool = False  # a marker at its end (e.g. the pod was preempted)


def number(value: float) -> str:
    """A tick label: at most 3 significant digits, no exponent for everyday magnitudes."""
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _span(low: float, high: float) -> tuple[float, float]:
    """[low, high], widened around a single value so that it still scales."""
    if high > low:
        return low, high
    pad = abs(low) * 0.1 or 1.0
    return low - pad, high + pad


class _Scale:
    """Data units to pixels across [``lo``, ``hi``] onto [``px_lo``, ``px_hi``]."""

    def __init__(self, lo: float, hi: float, px_lo: float, px_hi: float) -> None:
        self.lo, self.hi = _span(lo, hi)
        self.px_lo, self.px_hi = px_lo, px_hi

    def __call__(self, value: float) -> float:
        return self.px_lo + (value - self.lo) / (self.hi - self.lo) * (self.px_hi - self.px_lo)


def _text(x: float, y: float, text: str, *, anchor: str = "start", css: str = "label") -> str:
    return (
        f'<text class="{css}" x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{TEXT_COLOR}">{escape(text)}</text>'
    )


def _axes(x: _Scale, y: _Scale, *, x_label: str, y_label: str, y_ticks: bool = True) -> list[str]:
    left, right, top, bottom = x.px_lo, x.px_hi, y.px_hi, y.px_lo
    parts = [
        f'<line class="axis" x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="{AXIS_COLOR}"/>',
        f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="{AXIS_COLOR}"/>',
        _text(left, bottom + 16, number(x.lo), anchor="middle"),
        _text(right, bottom + 16, number(x.hi), anchor="end"),
        _text((left + right) / 2, bottom + 34, x_label, anchor="middle"),
    ]
    if y_ticks:
        parts += [
            _text(left - 6, bottom, number(y.lo), anchor="end"),
            _text(left - 6, top + 10, number(y.hi), anchor="end"),
        ]
    parts.append(
        f'<text class="label" transform="translate(14 {(top + bottom) / 2:.1f}) rotate(-90)" '
        f'text-anchor="middle" fill="{TEXT_COLOR}">{escape(y_label)}</text>'
    )
    return parts


def _svg(width: int, height: int, name: str, parts: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="{escape(name)}" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img">'
        f'<rect class="background" width="{width}" height="{height}" fill="#ffffff"/>{"".join(parts)}</svg>'
    )


def _legend(items: Sequence[tuple[str, str, str | None]], *, x: float, y: float) -> list[str]:
    """(label, color, dash) swatches, one per row from (x, y)."""
    parts = []
    for i, (label, color, dash) in enumerate(items):
        row = y + i * _LEGEND_ROW
        dasharray = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(
            f'<g class="legend-item"><line x1="{x}" y1="{row - 4}" x2="{x + 22}" y2="{row - 4}" stroke="{color}" '
            f'stroke-width="3"{dasharray}/>{_text(x + 28, row, label)}</g>'
        )
    return parts


def line_chart(
    name: str,
    series: Sequence[Series],
    *,
    x_label: str,
    y_label: str,
    width: int = 900,
    height: int = 300,
    empty: str = "nothing to draw yet",
) -> str:
    """Lines of ``series`` on shared axes (y from 0, or below where data goes negative), a legend
    under the plot; ``empty`` is written in place of lines when no series has a point."""
    points = [p for s in series for p in s.points]
    legend_height = _LEGEND_ROW * len(series) + 6 if len(series) > 1 else 0
    plot_bottom = height - _MARGIN_BOTTOM - legend_height
    xs, ys = [p[0] for p in points] or [0.0], [p[1] for p in points] or [0.0]
    x = _Scale(min(xs), max(xs), _MARGIN_LEFT, width - _MARGIN_RIGHT)
    y = _Scale(min(0.0, min(ys)), max(ys), plot_bottom, _MARGIN_TOP)
    parts = _axes(x, y, x_label=x_label, y_label=y_label)
    if not points:
        parts.append(_text((x.px_lo + x.px_hi) / 2, (y.px_lo + y.px_hi) / 2, empty, anchor="middle", css="empty"))
    for s in series:
        if not s.points:
            continue
        coords = " ".join(f"{x(px):.1f},{y(py):.1f}" for px, py in s.points)
        dasharray = f' stroke-dasharray="{s.dash}"' if s.dash else ""
        group = [
            f'<polyline class="series" points="{coords}" fill="none" stroke="{s.color}" stroke-width="2.5"{dasharray}/>'
        ]
        if s.markers:
            group += [
                f'<circle class="point" cx="{x(px):.1f}" cy="{y(py):.1f}" r="4" fill="{s.color}"/>'
                for px, py in s.points
            ]
        parts.append(
            f'<g class="series-group" data-series="{escape(s.name)}" data-points="{len(s.points)}">'
            f"<title>{escape(s.name)}</title>{''.join(group)}</g>"
        )
    if legend_height:
        parts += _legend([(s.name, s.color, s.dash) for s in series], x=_MARGIN_LEFT, y=height - legend_height + 8)
    return _svg(width, height, name, parts)


def timeline_chart(
    name: str,
    bars: Sequence[Bar],
    *,
    x_range: tuple[float, float],
    x_label: str,
    legend: Sequence[tuple[str, str]] = (),
    width: int = 900,
    row_height: int = 18,
    empty: str = "none ran",
) -> str:
    """One row per distinct ``Bar.row`` (in first-seen order), each bar from its start to its end
    over ``x_range``; a marked bar ends in a cross. ``legend``: (label, color) swatches."""
    rows = {row: i for i, row in enumerate(dict.fromkeys(b.row for b in bars))}  # row -> its index, top down
    legend_items = [(label, color, None) for label, color in legend]
    if any(b.marked for b in bars):
        legend_items.append(("preempted", MARK_COLOR, None))
    legend_height = _LEGEND_ROW * len(legend_items) + 6 if legend_items else 0
    plot_height = max(1, len(rows)) * row_height
    height = _MARGIN_TOP + plot_height + _MARGIN_BOTTOM + legend_height
    plot_bottom = _MARGIN_TOP + plot_height
    x = _Scale(*x_range, _MARGIN_LEFT, width - _MARGIN_RIGHT)
    y = _Scale(0, max(1, len(rows)), plot_bottom, _MARGIN_TOP)
    parts = _axes(x, y, x_label=x_label, y_label="", y_ticks=False)
    if not bars:
        parts.append(_text((x.px_lo + x.px_hi) / 2, (y.px_lo + y.px_hi) / 2 + 4, empty, anchor="middle", css="empty"))
    for row, i in rows.items():
        parts.append(_text(x.px_lo - 6, _MARGIN_TOP + (i + 0.5) * row_height + 4, row, anchor="end", css="row-label"))
    for b in bars:
        top = _MARGIN_TOP + rows[b.row] * row_height + 3
        left, right = x(b.start), max(x(b.end), x(b.start) + 2)  # a pod of a few seconds stays visible
        parts.append(
            f'<rect class="bar {escape(b.kind)}" x="{left:.1f}" y="{top:.1f}" width="{right - left:.1f}" '
            f'height="{row_height - 6}" fill="{b.color}"><title>{escape(b.title)}</title></rect>'
        )
        if b.marked:
            cy, r = top + (row_height - 6) / 2, 6
            parts.append(
                f'<path class="mark" d="M{right - r:.1f},{cy - r:.1f}L{right + r:.1f},{cy + r:.1f}'
                f'M{right - r:.1f},{cy + r:.1f}L{right + r:.1f},{cy - r:.1f}" stroke="{MARK_COLOR}" stroke-width="3"/>'
            )
    if legend_items:
        parts += _legend(legend_items, x=_MARGIN_LEFT, y=height - legend_height + 8)
    return _svg(width, height, name, parts)
