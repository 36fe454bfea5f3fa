"""`treadle bench serve --plot`: one self-contained HTML page of inline SVG charts."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from treadle.cli.bench_metrics import RequestResult, compute_metrics, summary_rows
from treadle.cli.bench_plot import nice_ticks, render_report, write_report

CHARTS = ("throughput", "hist-ttft", "hist-tpot", "hist-itl", "hist-e2el", "timeline")
SVG = "{http://www.w3.org/2000/svg}"


def _results() -> list[RequestResult]:
    """12 requests of 20 tokens, 4 at a time, 50 ms apart, and one failure."""
    out = []
    for i in range(12):
        start, ttft = 100.0 + (i // 4) * 1.5, 0.1 + 0.01 * i
        out.append(RequestResult(32, True, 20, ttft, [0.05] * 19, ttft + 0.95, start_time=start))
    out.append(RequestResult(32, error="HTTP 500: <oops> & more", start_time=100.2, latency=0.3))
    return out


def _svgs(page: str) -> dict[str, ET.Element]:
    """Every chart of the page, parsed: each must be well-formed XML on its own."""
    found = {}
    for text in re.findall(r"<svg .*?</svg>", page, flags=re.S):
        svg = ET.fromstring(text)
        found[svg.attrib["id"]] = svg
    return found


def _series(svg: ET.Element) -> dict[str, ET.Element]:
    return {e.attrib["data-series"]: e for e in svg.iter() if e.get("class") == "series"}


def test_report_is_one_self_contained_page_with_every_chart(tmp_path: Path) -> None:
    results = _results()
    metrics = compute_metrics(results, duration=4.5, percentiles=(50, 99))
    rows = summary_rows(metrics, 4, ("ttft", "tpot", "itl", "e2el"), (50, 99))
    path = tmp_path / "deep" / "report.html"
    path.parent.mkdir()
    write_report(path, results, metrics, rows, "Model tiny <test>")
    page = path.read_text()

    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and "http://" not in page.replace(SVG[1:-1], "")
    assert "Model tiny &lt;test&gt;" in page and "HTTP 500: &lt;oops&gt; &amp; more" in page
    for label in ("Successful requests:", "Peak concurrent requests:", "P50 TTFT (ms):"):
        assert label in page
    assert "Time to First Token" in page and "End-to-end Latency" in page

    svgs = _svgs(page)
    assert set(svgs) == set(CHARTS)
    throughput = _series(svgs["throughput"])
    assert set(throughput) == {"output_tokens_per_s", "mean_output_throughput"}
    # One point per 1 s bin; the points' heights are the bins' token counts.
    points = throughput["output_tokens_per_s"].attrib["points"].split()
    assert len(points) == 6  # the last request ends 4.16 s after the first starts
    for name in ("ttft", "tpot", "itl", "e2el"):
        bars = _series(svgs[f"hist-{name}"])[name]
        counts = [int(r.find(f"{SVG}title").text.split(": ")[1]) for r in bars]  # type: ignore[union-attr]
        # every successful request once; ITL pools 19 gaps of each
        assert sum(counts) == (12 * 19 if name == "itl" else 12), name
    timeline = _series(svgs["timeline"])
    assert [len(timeline[k]) for k in ("first_token", "decode", "failed")] == [12, 12, 1]


def test_no_successful_request_still_gives_a_page() -> None:
    results = [RequestResult(8, error="refused")]
    metrics = compute_metrics(results, duration=0.0)
    page = render_report(results, metrics, summary_rows(metrics), "nothing worked")
    svgs = _svgs(page)
    assert set(svgs) == set(CHARTS)
    assert all("no data" in ET.tostring(svg, encoding="unicode") for svg in svgs.values())


def test_ticks_are_round_numbers_inside_the_range() -> None:
    assert nice_ticks(0, 10) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(0.13, 0.91) == [0.2, 0.4, 0.6, 0.8]
    assert nice_ticks(212, 698) == [300, 400, 500, 600]
    assert nice_ticks(5, 5) == [5]
