"""Prometheus metrics of the front end, with vLLM's names under the `treadle:` prefix.

With several API servers (`--api-server-count`), each writes its values to
`PROMETHEUS_MULTIPROC_DIR` (set by the supervisor) and `/metrics` in any of them reports the
sum over all (gauges: the most recent value). Request timings (TTFT, inter-token latency,
end-to-end) are measured here, where outputs arrive; scheduler gauges and counters come from the `SchedulerStats` the engine core sends
with its outputs (counters there are cumulative, so they are added here as differences).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from treadle.outputs import RequestOutput
from treadle.wire.engine import SchedulerStats

_LABELS = ["model_name", "engine"]
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_metrics: dict[str, Any] = {}


def _registry() -> dict[str, Any]:
    """The metric objects, made once per process (prometheus_client registers them globally)."""
    if not _metrics:
        p = "treadle:"
        _metrics.update(
            running=Gauge(
                p + "num_requests_running",
                "Requests in the running batch",
                _LABELS,
                multiprocess_mode="mostrecent",
            ),
            waiting=Gauge(
                p + "num_requests_waiting",
                "Requests waiting to be scheduled",
                _LABELS,
                multiprocess_mode="mostrecent",
            ),
            kv_usage=Gauge(
                p + "kv_cache_usage_perc",
                "Fraction of KV blocks in use (0-1)",
                _LABELS,
                multiprocess_mode="mostrecent",
            ),
            prompt_tokens=Counter(p + "prompt_tokens", "Prefilled prompt tokens", _LABELS),
            generation_tokens=Counter(p + "generation_tokens", "Generated tokens", _LABELS),
            success=Counter(
                p + "request_success", "Finished requests", [*_LABELS, "finished_reason"]
            ),
            preemptions=Counter(p + "num_preemptions", "Preempted requests", _LABELS),
            prefix_queries=Counter(
                p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", _LABELS
            ),
            prefix_hits=Counter(
                p + "prefix_cache_hits", "Prompt tokens found in the prefix cache", _LABELS
            ),
            ttft=Histogram(
                p + "time_to_first_token_seconds",
                "Time to first token",
                _LABELS,
                buckets=_LATENCY_BUCKETS,
            ),
            itl=Histogram(
                p + "inter_token_latency_seconds",
                "Time between tokens",
                _LABELS,
                buckets=_LATENCY_BUCKETS,
            ),
            restarts=Counter(
                p + "engine_restarts", "Engine core restarts after a death or a stall", _LABELS
            ),
            resumed=Counter(
                p + "requests_resumed", "Requests resumed on a restarted engine core", _LABELS
            ),
            poisoned=Counter(
                p + "requests_failed_poison",
                "Requests failed because the engine core died twice while running them",
                _LABELS,
            ),
            e2e=Histogram(
                p + "e2e_request_latency_seconds",
                "Request latency",
                _LABELS,
                buckets=_LATENCY_BUCKETS,
            ),
        )
    return _metrics


@dataclass
class RequestTimes:
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


class StatLogger:
    """One engine's metrics as this front end sees them. `count_engine_totals=False` skips
    the engine's cumulative counters (preemptions, prefix cache): with several API servers
    they reach every one of them, and only one may add them up."""

    def __init__(self, model_name: str, engine: int = 0, count_engine_totals: bool = True) -> None:
        self.m = _registry()
        self.labels = {"model_name": model_name, "engine": str(engine)}
        self.count_engine_totals = count_engine_totals
        self._last = SchedulerStats()
        # Plain totals for the periodic log line (`log_line`).
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def _get(self, name: str, **extra: str) -> Any:
        return self.m[name].labels(**self.labels, **extra)

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self._get("running").set(stats.num_running_reqs)
        self._get("waiting").set(stats.num_waiting_reqs)
        self._get("kv_usage").set(stats.kv_cache_usage)
        if not self.count_engine_totals:
            return
        for name, attr in (
            ("preemptions", "num_preemptions"),
            ("prefix_queries", "prefix_cache_queries"),
            ("prefix_hits", "prefix_cache_hits"),
        ):
            delta = getattr(stats, attr) - getattr(self._last, attr)
            if delta > 0:
                self._get(name).inc(delta)
        self._last = stats

    def record_event(self, kind: str, count: int) -> None:
        """An engine restart event: "restarted", "resumed" or "poisoned" (requests)."""
        if kind == "restarted" and not self.count_engine_totals:
            return  # every API server sees a restart; only one counts it
        name = {"restarted": "restarts", "resumed": "resumed", "poisoned": "poisoned"}[kind]
        self._get(name).inc(count)

    def record_output(self, times: RequestTimes, out: RequestOutput, now: float) -> None:
        tokens = sum(len(c.token_ids) for c in out.outputs)
        new = tokens - times.num_tokens
        if new > 0:
            if times.first_token is None:
                times.first_token = now
                self._get("ttft").observe(now - times.arrival)
                self._get("prompt_tokens").inc(times.num_prompt_tokens)
                self.prompt_tokens += times.num_prompt_tokens
            elif times.last_token is not None:
                self._get("itl").observe((now - times.last_token) / new)
            times.last_token = now
            times.num_tokens = tokens
            self._get("generation_tokens").inc(new)
            self.generation_tokens += new
        if out.finished:
            self._get("e2e").observe(now - times.arrival)
            for c in out.outputs:
                self._get("success", finished_reason=c.finish_reason or "abort").inc()


def log_line(engine: int, stats: SchedulerStats, prompt_tps: float, generation_tps: float) -> str:
    """vLLM's periodic line (`--disable-log-stats` turns it off)."""
    queries = stats.prefix_cache_queries
    hit_rate = 100.0 * stats.prefix_cache_hits / queries if queries else 0.0
    return (
        f"Engine {engine:03d}: Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
        f"Avg generation throughput: {generation_tps:.1f} tokens/s, "
        f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
        f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, "
        f"Prefix cache hit rate: {hit_rate:.1f}%"
    )


def render_metrics() -> bytes:
    """The Prometheus text of this process, or of all API servers in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest()
