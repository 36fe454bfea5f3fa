"""The dashboard's rolling latency window: percentiles, expiry, and TTFT/TPOT from a request's
outputs as they arrive."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from treadle.frontend.live_stats import LatencyWindow, RollingWindow, percentile
from treadle.frontend.request_stats import FinishedRequestStats, IterationStats


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_percentile_matches_numpy(n: int) -> None:
    values = [random.Random(n).uniform(0, 5) for _ in range(n)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 50))


def test_rolling_window_forgets_old_samples_and_caps_its_size() -> None:
    window = RollingWindow(window_s=10.0, max_samples=5)
    for t in range(8):
        window.add(float(t), now=float(t))
    assert window.values(now=7.0) == [3.0, 4.0, 5.0, 6.0, 7.0]  # the cap
    assert window.values(now=15.5) == [6.0, 7.0]  # older than 10 s: gone
    assert window.values(now=100.0) == []


def _iteration(now: float, ttfts: list[float], tpots: list[tuple[int, float]]) -> IterationStats:
    """A batch of outputs as `RequestStatsTable.iteration` reports it: first tokens, and
    finished requests as (tokens generated, mean time per output token)."""
    it = IterationStats(now=now, engine_ts=now, time_to_first_tokens=list(ttfts))
    for tokens, tpot in tpots:
        it.finished_requests.append(
            FinishedRequestStats("length", 1.0, 3, tokens, None, mean_time_per_output_token=tpot)
        )
    return it


def test_latency_window_takes_ttft_at_the_first_token_and_tpot_at_the_end() -> None:
    window = LatencyWindow(num_engines=2)
    window.observe(1, _iteration(10.5, [0.5], []))
    window.observe(1, _iteration(10.7, [], []))  # no first token, nothing finished
    window.observe(1, _iteration(11.3, [], [(5, 0.2)]))
    summary = window.summary(1, now=12.0)
    assert summary["ttft_count"] == 1 and summary["ttft_p50"] == pytest.approx(0.5)
    assert summary["tpot_count"] == 1 and summary["tpot_p99"] == pytest.approx(0.2)
    assert window.summary(0, now=12.0) == {
        "ttft_count": 0,
        "tpot_count": 0,
        "ttft_p50": None,
        "ttft_p99": None,
        "tpot_p50": None,
        "tpot_p99": None,
    }
    assert window.summary(1, now=80.0)["ttft_count"] == 0  # a minute on: forgotten


def test_a_one_token_request_has_a_ttft_and_no_tpot() -> None:
    window = LatencyWindow(num_engines=1)
    window.observe(0, _iteration(0.25, [0.25], [(1, 0.0)]))
    summary = window.summary(0, now=1.0)
    assert (summary["ttft_count"], summary["tpot_count"]) == (1, 0)
    assert summary["ttft_p50"] == pytest.approx(0.25)
