"""`treadle bench serve --plot FILE.html`: one self-contained HTML report of a run, drawn here as
inline SVG (no JavaScript, nothing fetched): the summary table, output tokens/s per 1 s bin,
histograms of TTFT, TPOT, ITL and E2EL, and a per-request timeline.

Each chart is an `<svg id=...>` (`throughput`, `hist-ttft`, `hist-tpot`, `hist-itl`,
`hist-e2el`, `timeline`) whose drawn data carry `class="series" data-series=NAME`."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from treadle.cli.bench_metrics import (
    SECTIONS,
    RequestResult,
    latency_samples,
    output_tokens_per_second,
)

WIDTH, HEIGHT = 720, 300
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 30, 44  # margins around the plotting area
TIMELINE_ROWS = 200  # requests drawn in the timeline, the first sent
COLORS = {"ttft": "#4c72b0", "tpot": "#dd8452", "itl": "#55a868", "e2el": "#8172b3"}
STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px auto; max-width: 760px; color: #222; }
table { border-collapse: collapse; margin-bottom: 16px; }
td { padding: 1px 12px 1px 0; } td.v { text-align: right; font-variant-numeric: tabular-nums; }
tr.section td { padding-top: 8px; font-weight: 600; }
svg { display: block; margin: 8px 0 20px; }
"""


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (steps of 1, 2 or 5 x 10^k) covering [lo, hi]."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    first = math.ceil(lo / step - 1e-9)
    return [round(i * step, 12) for i in range(first, math.floor(hi / step + 1e-9) + 1)]


def _num(v: float) -> str:
    return f"{v:.1f}"


@dataclass(frozen=True, slots=True)
class _Frame:
    """Maps data coordinates onto the plotting area of one chart."""

    x0: float
    x1: float
    y0: float
    y1: float
    height: int = HEIGHT

    def x(self, v: float) -> float:
        return LEFT + (v - self.x0) / ((self.x1 - self.x0) or 1) * (WIDTH - LEFT - RIGHT)

    def y(self, v: float) -> float:
        return (
            self.height
            - BOTTOM
            - (v - self.y0) / ((self.y1 - self.y0) or 1) * (self.height - TOP - BOTTOM)
        )

    def axes(self, title: str, x_label: str, y_label: str, y_ticks: bool = True) -> list[str]:
        out = [f'<text x="{LEFT}" y="18" font-weight="600">{html.escape(title)}</text>']
        bottom, top = self.y(self.y0), self.y(self.y1)
        for t in nice_ticks(self.x0, self.x1):
            out.append(
                f'<line stroke="#e4e4e4" x1="{_num(self.x(t))}" x2="{_num(self.x(t))}" '
                f'y1="{_num(top)}" y2="{_num(bottom)}"/>'
            )
            out.append(
                f'<text x="{_num(self.x(t))}" y="{_num(bottom + 14)}" '
                f'text-anchor="middle">{t:g}</text>'
            )
        if y_ticks:
            for t in nice_ticks(self.y0, self.y1):
                out.append(
                    f'<line stroke="#e4e4e4" x1="{LEFT}" x2="{WIDTH - RIGHT}" '
                    f'y1="{_num(self.y(t))}" y2="{_num(self.y(t))}"/>'
                )
                out.append(
                    f'<text x="{LEFT - 6}" y="{_num(self.y(t) + 4)}" text-anchor="end">{t:g}</text>'
                )
        out.append(
            f'<line stroke="#888" x1="{LEFT}" x2="{WIDTH - RIGHT}" '
            f'y1="{_num(bottom)}" y2="{_num(bottom)}"/>'
        )
        out.append(
            f'<line stroke="#888" x1="{LEFT}" x2="{LEFT}" y1="{_num(top)}" y2="{_num(bottom)}"/>'
        )
        out.append(
            f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{self.height - 8}" '
            f'text-anchor="middle">{html.escape(x_label)}</text>'
        )
        out.append(
            f'<text transform="translate(14 {(top + bottom) / 2:.0f}) rotate(-90)" '
            f'text-anchor="middle">{html.escape(y_label)}</text>'
        )
        return out


def _svg(chart_id: str, title: str, parts: Sequence[str], height: int = HEIGHT) -> str:
    body = "\n".join(parts)
    return (
        f'<svg id="{chart_id}" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
        f'height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'font-family="system-ui, sans-serif" font-size="11">'
        f"<title>{html.escape(title)}</title>\n{body}\n</svg>"
    )


def _no_data(chart_id: str, title: str) -> str:
    return _svg(
        chart_id,
        title,
        [
            f'<text x="{LEFT}" y="18" font-weight="600">{html.escape(title)}</text>',
            f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no data</text>',
        ],
    )


def throughput_chart(results: list[RequestResult], mean_throughput: float) -> str:
    """Output tokens received in each 1 s bin, with the run's mean as a dashed line."""
    title = "Output token throughput over time"
    bins = output_tokens_per_second(results)
    if not bins:
        return _no_data("throughput", title)
    frame = _Frame(0, len(bins), 0, max(max(bins), mean_throughput, 1) * 1.05)
    parts = frame.axes(title, "seconds since the first request", "output tokens/s")
    points = " ".join(f"{_num(frame.x(i + 0.5))},{_num(frame.y(n))}" for i, n in enumerate(bins))
    parts.append(
        f'<polyline class="series" data-series="output_tokens_per_s" fill="none" '
        f'stroke="{COLORS["ttft"]}" stroke-width="2" points="{points}"/>'
    )
    y = _num(frame.y(mean_throughput))
    parts.append(
        f'<line class="series" data-series="mean_output_throughput" x1="{LEFT}" '
        f'x2="{WIDTH - RIGHT}" y1="{y}" y2="{y}" stroke="#c44e52" '
        f'stroke-dasharray="6 4"/>'
    )
    parts.append(
        f'<text x="{WIDTH - RIGHT}" y="{float(y) - 4:.1f}" text-anchor="end" '
        f'fill="#c44e52">mean {mean_throughput:.1f} tok/s</text>'
    )
    return _svg("throughput", title, parts)


def histogram_chart(name: str, title: str, values_ms: list[float]) -> str:
    """A histogram of one latency metric, with its median and p99 marked."""
    chart_id = f"hist-{name}"
    if not values_ms:
        return _no_data(chart_id, title)
    arr = np.asarray(values_ms, dtype=np.float64)
    lo, hi = float(arr.min()), float(arr.max())
    if hi - lo < 1e-6 * max(1.0, abs(hi)):  # (nearly) one value: numpy cannot bin it finely
        lo, hi = lo - 0.5, hi + 0.5
    bins = min(40, max(5, math.ceil(math.sqrt(arr.size))))
    counts, edges = np.histogram(arr, bins=bins, range=(lo, hi))
    frame = _Frame(float(edges[0]), float(edges[-1]), 0, float(counts.max()) * 1.1)
    parts = frame.axes(f"{title} ({arr.size} samples)", "ms", "count")
    bars = []
    edge = edges.tolist()
    for count, left, right in zip(counts.tolist(), edge, edge[1:], strict=False):
        x, x_end, top = frame.x(left), frame.x(right), frame.y(count)
        bars.append(
            f'<rect x="{_num(x)}" y="{_num(top)}" width="{max(x_end - x - 1, 1):.1f}" '
            f'height="{_num(frame.y(0) - top)}"><title>{left:.2f}-{right:.2f} ms: '
            f"{count}</title></rect>"
        )
    parts.append(
        f'<g class="series" data-series="{name}" fill="{COLORS[name]}">' + "".join(bars) + "</g>"
    )
    for row, (label, value, dash) in enumerate(
        (("median", float(np.median(arr)), "4 3"), ("p99", float(np.percentile(arr, 99)), ""))
    ):
        mark = frame.x(value)
        parts.append(
            f'<line x1="{_num(mark)}" x2="{_num(mark)}" y1="{TOP}" y2="{_num(frame.y(0))}" '
            f'stroke="#222" stroke-dasharray="{dash}"/>'
        )
        # beside its line, on the side with room for it
        left = mark > WIDTH - RIGHT - 110
        parts.append(
            f'<text x="{_num(mark - 4 if left else mark + 4)}" y="{TOP + 10 + 13 * row}" '
            f'text-anchor="{"end" if left else "start"}">{label} {value:.1f} ms</text>'
        )
    return _svg(chart_id, title, parts)


def _legend(entries: Sequence[tuple[str, str]]) -> str:
    """Colour swatches and names in a row at the top right."""
    out, x = [], WIDTH - RIGHT
    for name, color in reversed(entries):
        x -= 7 * len(name) + 22
        out.append(
            f'<rect x="{x}" y="9" width="10" height="10" fill="{color}"/>'
            f'<text x="{x + 14}" y="18">{html.escape(name)}</text>'
        )
    return "".join(out)


def timeline_chart(results: list[RequestResult]) -> str:
    """One row per request (the first TIMELINE_ROWS sent): waiting for the first token, then
    streaming the rest; failed requests in grey up to their failure."""
    title = "Requests over time"
    shown = sorted(results, key=lambda r: r.start_time)[:TIMELINE_ROWS]
    if not shown or not any(r.success for r in shown):
        return _no_data("timeline", title)
    t0 = shown[0].start_time
    end = max(r.start_time + r.latency for r in shown) - t0
    row = max(2.0, min(10.0, 400 / len(shown)))
    height = int(TOP + BOTTOM + row * len(shown))
    frame = _Frame(0, max(end, 1e-3), len(shown), 0, height)
    parts = frame.axes(
        title,
        "seconds since the first request",
        "request",
        y_ticks=False,
    )
    first, rest, failed = [], [], []
    for i, r in enumerate(shown):
        start, y = r.start_time - t0, _num(TOP + i * row)
        h = f'height="{max(row - 1, 1):.1f}"'
        if not r.success:
            width = max(frame.x(start + r.latency) - frame.x(start), 1)
            failed.append(f'<rect x="{_num(frame.x(start))}" y="{y}" width="{width:.1f}" {h}/>')
            continue
        ttft_end, done = start + r.ttft, start + r.latency
        first.append(
            f'<rect x="{_num(frame.x(start))}" y="{y}" '
            f'width="{max(frame.x(ttft_end) - frame.x(start), 1):.1f}" {h}/>'
        )
        if done > ttft_end:
            rest.append(
                f'<rect x="{_num(frame.x(ttft_end))}" y="{y}" '
                f'width="{frame.x(done) - frame.x(ttft_end):.1f}" {h}/>'
            )
    for name, color, rects in (
        ("first_token", COLORS["ttft"], first),
        ("decode", COLORS["itl"], rest),
        ("failed", "#aaa", failed),
    ):
        parts.append(
            f'<g class="series" data-series="{name}" fill="{color}">' + "".join(rects) + "</g>"
        )
    parts.append(
        _legend(
            [("until the first token", COLORS["ttft"]), ("the rest", COLORS["itl"])]
            + ([("failed", "#aaa")] if failed else [])
        )
    )
    return _svg("timeline", title, parts, height)


def _table(rows: list[tuple[str, Any] | str]) -> str:
    out = ["<table>"]
    for row in rows:
        if isinstance(row, str):
            out.append(f'<tr class="section"><td colspan="2">{html.escape(row)}</td></tr>')
        else:
            label, value = row
            shown = f"{value:.2f}" if isinstance(value, float) else str(value)
            out.append(f'<tr><td>{html.escape(label)}</td><td class="v">{shown}</td></tr>')
    out.append("</table>")
    return "\n".join(out)


def render_report(
    results: list[RequestResult],
    metrics: dict[str, Any],
    rows: list[tuple[str, Any] | str],
    heading: str,
) -> str:
    """The whole HTML page: `heading`, the summary `rows` (`bench_metrics.summary_rows`), then
    the charts."""
    samples = latency_samples(results)
    charts = [throughput_chart(results, float(metrics["output_throughput"]))]
    charts += [
        histogram_chart(key, f"{short}: {title}", [v * 1000 for v in samples[key]])
        for key, short, title in SECTIONS
    ]
    charts.append(timeline_chart(results))
    error = metrics.get("first_error")
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{html.escape(heading)}</title><style>{STYLE}</style></head><body>",
            "<h1>Serving Benchmark Result</h1>",
            f"<p>{html.escape(heading)}</p>",
            _table(rows),
            f"<p>First error: {html.escape(str(error))}</p>" if error else "",
            *charts,
            "</body></html>",
            "",
        ]
    )


def write_report(
    path: str | Path,
    results: list[RequestResult],
    metrics: dict[str, Any],
    rows: list[tuple[str, Any] | str],
    heading: str,
) -> None:
    Path(path).write_text(render_report(results, metrics, rows, heading), encoding="utf-8")
