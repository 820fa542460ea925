"""Charts drawn on the server as SVG (no charting library to ship): a bar per day."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe


@dataclass
class Series:
    label: str
    unit: str
    values: list[float]
    css: str  # the bar's class (its colour comes from the stylesheet)


def _nice_max(v: float) -> float:
    """The smallest 1, 2 or 5 × 10^n at or above ``v`` (a round top for the axis)."""
    if v <= 0:
        return 1.0
    exp = math.floor(math.log10(v))
    for m in (1, 2, 5, 10):
        top = m * 10**exp
        if top >= v * 0.9999:
            return float(top)
    return float(10 ** (exp + 1))


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.1f}".rstrip("0").rstrip(".")
    return f"{v:.3g}"


def bar_chart(days: list[date], series: list[Series], *, width: int = 720, height: int = 180,
              title: str = "") -> SafeString:  # fmt: skip
    """Bars per day, one group per day and one bar per series, each with a tooltip; a y axis
    with a round top and gridlines; day labels spaced to stay legible."""
    left, right, top, bottom = 52, 8, 10, 24
    plot_w, plot_h = width - left - right, height - top - bottom
    n = max(len(days), 1)
    peak = max((v for s in series for v in s.values), default=0.0)
    ymax = _nice_max(peak)
    group_w = plot_w / n
    bar_w = max(1.0, (group_w * 0.8) / max(len(series), 1))
    out = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="100%" role="img" '
        f'aria-label="{escape(title)}" preserveAspectRatio="xMinYMin meet">',
        f"<title>{escape(title)}</title>",
    ]
    for i in range(5):  # gridlines and the y axis's labels
        v = ymax * i / 4
        y = top + plot_h - plot_h * i / 4
        out.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(f'<text class="axis" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
    label_every = max(1, math.ceil(n / 12))
    for d_i, day in enumerate(days):
        gx = left + d_i * group_w + group_w * 0.1
        for s_i, s in enumerate(series):
            v = s.values[d_i] if d_i < len(s.values) else 0.0
            h = plot_h * v / ymax if ymax else 0
            x = gx + s_i * bar_w
            out.append(
                f'<rect class="bar {escape(s.css)}" x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{bar_w:.1f}" '
                f'height="{h:.1f}"><title>{day.isoformat()}: '
                f"{' '.join(p for p in (_fmt(v), escape(s.unit), escape(s.label)) if p)}</title></rect>"
            )
        if d_i % label_every == 0:
            cx = left + d_i * group_w + group_w / 2
            out.append(f'<text class="axis" x="{cx:.1f}" y="{height - 6}" text-anchor="middle">'
                       f"{day.strftime('%b %d')}</text>")  # fmt: skip
    out.append("</svg>")
    return mark_safe("".join(out))  # noqa: S308 - every value put in it is escaped or a number
