"""`treadle bench serve`'s numbers on made-up request records: vLLM's metrics, result keys,
table rows and percentile flags."""

from __future__ import annotations

import math

import pytest

from treadle.cli.bench_client import arrival_gaps
from treadle.cli.bench_metrics import (
    RequestResult,
    compute_metrics,
    format_table,
    output_tokens_per_second,
    parse_percentile_metrics,
    parse_percentiles,
    peak_concurrency,
    percentile_name,
)


def _ok(
    ttft: float, latency: float, tokens: int, prompt_len: int = 10, start: float = 0.0
) -> RequestResult:
    itl = [(latency - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return RequestResult(prompt_len, True, tokens, ttft, itl, latency, start_time=start)


def test_metrics_totals_throughput_and_failures() -> None:
    results = [
        _ok(0.1, 1.1, 11),
        _ok(0.2, 2.2, 21, prompt_len=20),
        RequestResult(30, error="HTTP 400: bad prompt"),
        RequestResult(40, error="ClientConnectorError: refused"),
    ]
    m = compute_metrics(results, duration=4.0)
    assert m["completed"] == 2 and m["failed"] == 2
    assert m["first_error"] == "HTTP 400: bad prompt"
    assert m["total_input_tokens"] == 30  # failed requests are not counted
    assert m["total_output_tokens"] == 32
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(8.0)
    assert m["total_token_throughput"] == pytest.approx(15.5)
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["mean_e2el_ms"] == pytest.approx(1650.0)
    assert m["request_goodput"] is None


def test_tpot_skips_single_token_outputs() -> None:
    # TPOT = (e2e - ttft) / (tokens - 1): 1.0/10 = 100 ms and 2.0/5 = 400 ms; the one-token
    # request has no TPOT but its TTFT and E2EL still count.
    results = [_ok(0.1, 1.1, 11), _ok(0.5, 2.5, 6), _ok(0.3, 0.3, 1)]
    m = compute_metrics(results, duration=3.0)
    assert m["mean_tpot_ms"] == pytest.approx(250.0)
    assert m["median_tpot_ms"] == pytest.approx(250.0)
    assert m["mean_ttft_ms"] == pytest.approx(300.0)
    # ITL pools every gap: 10 of 100 ms and 5 of 400 ms.
    assert m["mean_itl_ms"] == pytest.approx((10 * 100 + 5 * 400) / 15)
    assert m["median_itl_ms"] == pytest.approx(100.0)


def test_percentiles_interpolate_like_numpy() -> None:
    # TTFTs of 1..100 ms: median 50.5, p99 by linear interpolation 99.01.
    results = [RequestResult(1, True, 1, t / 1000, [], t / 1000) for t in range(1, 101)]
    m = compute_metrics(results, duration=1.0)
    assert m["median_ttft_ms"] == pytest.approx(50.5)
    assert m["p99_ttft_ms"] == pytest.approx(99.01)
    assert m["mean_ttft_ms"] == pytest.approx(50.5)


def test_all_failed_reports_zeros_and_the_error() -> None:
    m = compute_metrics([RequestResult(5, error="boom")], duration=0.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["request_throughput"] == 0.0 and m["p99_e2el_ms"] == 0.0
    assert m["max_output_tokens_per_s"] == 0.0 and m["max_concurrent_requests"] == 0
    table = format_table(m, max_concurrency=4)
    assert "Failed requests:" in table and "First error: boom" in table
    assert "Maximum request concurrency:" in table


def test_table_rows_are_vllms() -> None:
    table = format_table(compute_metrics([_ok(0.1, 1.1, 11)], duration=2.0), request_rate=4.0)
    for label in (
        "Successful requests:",
        "Request rate configured (RPS):",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Peak output token throughput (tok/s):",
        "Peak concurrent requests:",
        "Total token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TPOT (ms):",
        "P99 ITL (ms):",
        "Mean E2EL (ms):",
    ):
        assert label in table
    assert "First error" not in table
    assert "Request rate configured" not in format_table(compute_metrics([], 1.0))


def test_arrivals_are_seeded_poisson() -> None:
    assert arrival_gaps(4, math.inf, seed=0) == [0.0] * 4
    gaps = arrival_gaps(2000, 10.0, seed=0)
    assert gaps == arrival_gaps(2000, 10.0, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)


def test_selected_percentiles_get_vllms_keys_and_rows() -> None:
    results = [RequestResult(1, True, 1, t / 1000, [], t / 1000) for t in range(1, 101)]
    m = compute_metrics(results, duration=1.0, percentiles=(25, 50, 99.9))
    assert m["p25_ttft_ms"] == pytest.approx(25.75) and m["p50_ttft_ms"] == pytest.approx(50.5)
    assert m["p99.9_e2el_ms"] == pytest.approx(99.901)
    assert m["p99_ttft_ms"] == pytest.approx(99.01) and m["std_ttft_ms"] > 0
    table = format_table(m, shown=("ttft",), percentiles=(25, 99.9))
    assert "P25 TTFT (ms):" in table and "P99.9 TTFT (ms):" in table and "TPOT" not in table


def test_percentile_flags_parse_or_say_what_is_wrong() -> None:
    assert parse_percentiles("25,50,99") == (25.0, 50.0, 99.0)
    assert parse_percentiles(" 99.9 , 50,50") == (99.9, 50.0)
    assert [percentile_name(p) for p in (25.0, 99.9, 100)] == ["25", "99.9", "100"]
    for bad, why in (
        ("", "expected numbers"),
        ("50,,99", "expected numbers"),
        ("p99", "'p99' is not a number"),
        ("101", "not in \\[0, 100\\]"),
        ("-1", "not in"),
        ("nan", "not in"),
    ):
        with pytest.raises(ValueError, match=f"--metric-percentiles: .*{why}"):
            parse_percentiles(bad)
    assert parse_percentile_metrics("ttft, e2el") == ("ttft", "e2el")
    with pytest.raises(ValueError, match="unknown goodput"):
        parse_percentile_metrics("ttft,goodput")
    with pytest.raises(ValueError, match="--percentile-metrics"):
        parse_percentile_metrics(",")


def test_tokens_per_second_bins_and_peak_concurrency() -> None:
    # A: sent at 10.0, first token at 10.5, then 4 more 0.5 s apart (last at 12.5).
    # B: sent at 11.2, one token at 11.4. A failed request counts for nothing.
    a = RequestResult(5, True, 5, 0.5, [0.5] * 4, 2.5, start_time=10.0)
    b = RequestResult(5, True, 1, 0.2, [], 0.2, start_time=11.2)
    failed = RequestResult(5, error="x", start_time=9.0, latency=5.0)
    assert output_tokens_per_second([a, b, failed]) == [1, 3, 2, 0]
    assert peak_concurrency([a, b, failed]) == 2
    assert peak_concurrency([a, RequestResult(5, True, 1, 0.1, [], 0.5, start_time=12.5)]) == 1
    m = compute_metrics([a, b], duration=2.5)
    assert m["max_output_tokens_per_s"] == 3.0 and m["max_concurrent_requests"] == 2
