"""`treadle bench serve`'s numbers: per-request records in, vLLM's serving metrics, result keys
and printed table out. Plain values only: nothing here talks HTTP."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")  # --percentile-metrics names, vLLM's


@dataclass(slots=True)
class RequestResult:
    """One benchmark request. Latencies are in seconds from the moment the request was sent;
    `start_time` is that moment on the `time.perf_counter` clock (vLLM's `start_times`)."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # until the first chunk with non-empty text
    itl: list[float] = field(default_factory=list)  # between successive non-empty text chunks
    latency: float = 0.0  # until the end of the stream
    error: str = ""
    start_time: float = 0.0


def percentile_name(p: float) -> str:
    """The `N` of vLLM's `pN_ttft_ms` keys and `PN TTFT (ms):` rows: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def parse_percentiles(text: str) -> tuple[float, ...]:
    """`--metric-percentiles 25,50,99` -> (25.0, 50.0, 99.0); ValueError saying what is wrong."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or not all(items):
        raise ValueError(f"--metric-percentiles: expected numbers like 50,90,99, got {text!r}")
    found = []
    for item in items:
        try:
            p = float(item)
        except ValueError:
            raise ValueError(f"--metric-percentiles: {item!r} is not a number") from None
        if not 0 <= p <= 100:  # also refuses nan
            raise ValueError(f"--metric-percentiles: {item} is not in [0, 100]")
        found.append(p)
    return tuple(dict.fromkeys(found))


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    """`--percentile-metrics ttft,e2el` -> ("ttft", "e2el"); ValueError for other names."""
    names = tuple(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))
    unknown = [n for n in names if n not in LATENCY_METRICS]
    if unknown or not names:
        raise ValueError(
            f"--percentile-metrics: unknown {', '.join(unknown) or repr(text)} "
            f"(choose from {','.join(LATENCY_METRICS)})"
        )
    return names


def token_times(result: RequestResult) -> list[float]:
    """When each streamed chunk arrived, on the `start_time` clock."""
    times = [result.start_time + result.ttft]
    for gap in result.itl:
        times.append(times[-1] + gap)
    return times


def output_tokens_per_second(results: list[RequestResult]) -> list[int]:
    """Chunks received in each 1 s bin from the first successful send (vLLM's peak-throughput
    bins; a chunk is one token on treadle and vLLM)."""
    ok = [r for r in results if r.success]
    if not ok:
        return []
    t0 = min(r.start_time for r in ok)
    bins = [0] * (math.ceil(max(r.start_time + r.latency for r in ok) - t0) + 1)
    for r in ok:
        for t in token_times(r):
            second = int(t - t0)
            if 0 <= second < len(bins):
                bins[second] += 1
    return bins


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most successful requests in flight at once (half-open [start, end) intervals)."""
    events = sorted(
        (t, delta)
        for r in results
        if r.success
        for t, delta in ((r.start_time, 1), (r.start_time + r.latency, -1))
    )
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def _stats_ms(
    values: list[float], percentiles: tuple[float, ...]
) -> tuple[float, float, float, dict[str, float]]:
    """(mean, median, std, {"p99": ...}) in ms; zeros for no values, as vLLM reports them."""
    names = [f"p{percentile_name(p)}" for p in percentiles]
    if not values:
        return 0.0, 0.0, 0.0, dict.fromkeys(names, 0.0)
    import numpy as np  # here, not at import: every spawned child of `treadle` imports the CLI

    arr = np.asarray(values, dtype=np.float64) * 1000.0
    found = {name: float(np.percentile(arr, p)) for name, p in zip(names, percentiles, strict=True)}
    return float(arr.mean()), float(np.median(arr)), float(arr.std()), found


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Seconds per latency metric over successful requests: TPOT = (e2e - ttft) /
    (output_tokens - 1) for requests with more than one output token; ITL pools every gap."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def compute_metrics(
    results: list[RequestResult],
    duration: float,
    percentiles: tuple[float, ...] = (99,),
) -> dict[str, Any]:
    """vLLM's serving metrics from per-request records, under its result-JSON keys. Token totals,
    throughputs and latencies count successful requests only. Every latency metric gets
    `mean_/median_/std_/p{N}_{metric}_ms` keys for each of `percentiles`
    (`--metric-percentiles`), and p99 always (vLLM writes the selected metrics only)."""
    percentiles = tuple(sorted({*percentiles, 99}))
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": per_second(len(ok)),
        "request_goodput": None,  # vLLM's, with --goodput only
        "output_throughput": per_second(total_output),
        "total_token_throughput": per_second(total_input + total_output),
        "max_output_tokens_per_s": float(max(output_tokens_per_second(results), default=0)),
        "max_concurrent_requests": peak_concurrency(results),
    }
    for name, values in latency_samples(results).items():
        mean, median, std, found = _stats_ms(values, percentiles)
        metrics[f"mean_{name}_ms"] = mean
        metrics[f"median_{name}_ms"] = median
        metrics[f"std_{name}_ms"] = std
        for p, value in found.items():
            metrics[f"{p}_{name}_ms"] = value
    metrics["first_error"] = failed[0].error if failed else None
    return metrics


SECTIONS = (  # (metric, short name, title) as vLLM prints them
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def summary_rows(
    metrics: dict[str, Any],
    max_concurrency: int | None = None,
    shown: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el"),
    percentiles: tuple[float, ...] = (99,),
    request_rate: float = math.inf,
) -> list[tuple[str, Any] | str]:
    """The result table's rows in vLLM's order: (label, value) pairs and section titles."""
    rows: list[tuple[str, Any] | str] = [
        ("Successful requests:", metrics["completed"]),
        ("Failed requests:", metrics["failed"]),
    ]
    if max_concurrency is not None:
        rows.append(("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        rows.append(("Request rate configured (RPS):", float(request_rate)))
    rows += [
        ("Benchmark duration (s):", float(metrics["duration"])),
        ("Total input tokens:", metrics["total_input_tokens"]),
        ("Total generated tokens:", metrics["total_output_tokens"]),
        ("Request throughput (req/s):", float(metrics["request_throughput"])),
        ("Output token throughput (tok/s):", float(metrics["output_throughput"])),
        ("Peak output token throughput (tok/s):", float(metrics["max_output_tokens_per_s"])),
        ("Peak concurrent requests:", float(metrics["max_concurrent_requests"])),
        ("Total token throughput (tok/s):", float(metrics["total_token_throughput"])),
    ]
    for key, short, title in SECTIONS:
        if key not in shown:
            continue
        rows.append(title)
        rows.append((f"Mean {short} (ms):", float(metrics[f"mean_{key}_ms"])))
        rows.append((f"Median {short} (ms):", float(metrics[f"median_{key}_ms"])))
        for p in percentiles:
            name = percentile_name(p)
            rows.append((f"P{name} {short} (ms):", float(metrics[f"p{name}_{key}_ms"])))
    return rows


def format_table(
    metrics: dict[str, Any],
    max_concurrency: int | None = None,
    shown: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el"),
    percentiles: tuple[float, ...] = (99,),
    request_rate: float = math.inf,
) -> str:
    """The result table, laid out as `vllm bench serve` prints it; `shown`
    (`--percentile-metrics`) and `percentiles` (`--metric-percentiles`) pick the latency rows."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    for row in summary_rows(metrics, max_concurrency, shown, percentiles, request_rate):
        if isinstance(row, str):
            lines.append(f"{row:-^50}")
        else:
            label, value = row
            lines.append(f"{label:<40} {f'{value:.2f}' if isinstance(value, float) else value:<10}")
    lines.append("=" * 50)
    if metrics.get("first_error"):
        lines.append(f"First error: {metrics['first_error']}")
    return "\n".join(lines)
