"""The dashboard's live numbers (`GET /dashboard/events`): each engine's load from its
`get_topology` report, and the TTFT and TPOT percentiles of this API server's recent
requests (`LatencyWindow`, fed where outputs arrive, in `AsyncLLM`).

With several API servers, each one sees only the requests it serves: the latency figures of
an event are those of the API server that sends it (`api_server` in the event).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from treadle.frontend.request_stats import IterationStats
from treadle.frontend.topology import engine_entry, engine_reports, engine_states

if TYPE_CHECKING:
    from treadle.frontend.async_llm import AsyncLLM

WINDOW_S = 60.0
"""Percentiles cover the requests of about the last minute."""
MAX_SAMPLES = 4096
"""... and at most this many of them per engine."""


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks, as numpy's
    default; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class RollingWindow:
    """Samples of the last `window_s` seconds (at most `max_samples`)."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=max_samples
        )

    def add(self, value: float, now: float) -> None:
        self._samples.append((now, value))

    def values(self, now: float) -> list[float]:
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        return [v for _, v in self._samples]


class LatencyWindow:
    """Per engine: time to first token (at the first token) and time per output token after
    the first (at the end of a request) of recent requests."""

    def __init__(self, num_engines: int, window_s: float = WINDOW_S) -> None:
        self.ttft = [RollingWindow(window_s) for _ in range(num_engines)]
        self.tpot = [RollingWindow(window_s) for _ in range(num_engines)]

    def observe(self, engine: int, it: IterationStats) -> None:
        """One batch of the engine's outputs, as `RequestStatsTable.iteration` saw it."""
        for ttft in it.time_to_first_tokens:
            self.ttft[engine].add(ttft, it.now)
        for done in it.finished_requests:
            if done.num_generation_tokens > 1 and done.mean_time_per_output_token is not None:
                self.tpot[engine].add(done.mean_time_per_output_token, it.now)

    def summary(self, engine: int, now: float) -> dict[str, float | int | None]:
        ttft = self.ttft[engine].values(now)
        tpot = self.tpot[engine].values(now)
        out: dict[str, float | int | None] = {"ttft_count": len(ttft), "tpot_count": len(tpot)}
        for name, values in (("ttft", ttft), ("tpot", tpot)):
            for q in (50, 99):
                value = percentile(values, q)
                out[f"{name}_p{q}"] = None if math.isnan(value) else value
        return out


async def snapshot(llm: AsyncLLM) -> dict[str, Any]:
    """One event of the dashboard's stream: every engine's load and this API server's
    latency percentiles."""
    states = engine_states(llm)
    reports = await engine_reports(llm, states)
    now = time.monotonic()
    engines = []
    for rank, state in enumerate(states):
        entry = engine_entry(rank, state, reports[rank])
        entry.update(llm.latencies.summary(rank, now))
        engines.append(entry)
    return {"time": time.time(), "api_server": llm.client_index, "engines": engines}
