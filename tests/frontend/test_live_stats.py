"""The dashboard's rolling latency window: percentiles, expiry, and TTFT/TPOT from a request's
outputs as they arrive."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from treadle.frontend.live_stats import LatencyWindow, RollingWindow, percentile
from treadle.frontend.metrics import RequestTimes
from treadle.outputs import CompletionOutput, RequestOutput


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


def _out(tokens: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, "", list(range(tokens)), None, None)
    return RequestOutput("r", None, [1], [completion], finished=finished)


def _record(times: RequestTimes, out: RequestOutput, now: float) -> None:
    """What `StatLogger.record_output` does to `times` after the window has seen them."""
    tokens = len(out.outputs[0].token_ids)
    if tokens > times.num_tokens:
        times.first_token = times.first_token or now
        times.last_token = now
        times.num_tokens = tokens


def test_latency_window_takes_ttft_at_the_first_token_and_tpot_at_the_end() -> None:
    window = LatencyWindow(num_engines=2)
    times = RequestTimes(arrival=10.0, num_prompt_tokens=3)
    for now, out in [
        (10.5, _out(1)),  # first token after 0.5 s
        (10.7, _out(3)),
        (10.7, _out(3)),  # no new token (e.g. stats only)
        (11.3, _out(5, finished=True)),  # 4 more tokens in 0.8 s: 0.2 s per token
    ]:
        window.observe(1, times, out, now)
        _record(times, out, now)
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


def test_a_one_token_request_has_a_ttft_and_no_tpot() -> None:
    window = LatencyWindow(num_engines=1)
    times = RequestTimes(arrival=0.0, num_prompt_tokens=3)
    window.observe(0, times, _out(1, finished=True), now=0.25)
    summary = window.summary(0, now=1.0)
    assert (summary["ttft_count"], summary["tpot_count"]) == (1, 0)
    assert summary["ttft_p50"] == pytest.approx(0.25)
