"""The per-request timings of the metrics: queue, prefill, decode, inference, time per output
token, TTFT, ITL (vLLM's definitions), from engine outputs made up here; and the dashboard's
rolling latency window: percentiles, expiry, and TTFT/TPOT from a request's outputs as they
arrive."""

import math
import random

import numpy as np
import pytest

from treadle.frontend.request_stats import (
    FinishedRequestStats,
    IterationStats,
    LatencyWindow,
    RequestStatsTable,
    RollingWindow,
    finished_request_stats,
    percentile,
)
from treadle.wire.engine import EngineCoreOutput, FinishReason

ARRIVAL = 1000.0  # front-end clock
T0 = 50.0  # engine clock


def out(rid: str, n: int = 1, **kw: object) -> EngineCoreOutput:
    return EngineCoreOutput(rid, list(range(n)), **kw)  # type: ignore[arg-type]


def test_phases_of_one_request() -> None:
    table = RequestStatsTable()
    table.add("r", ["r"], ARRIVAL, num_prompt_tokens=7, max_tokens=3)
    first = table.iteration([out("r", queue_time=0.5, prefill_time=0.25)], [], ARRIVAL + 1.0, T0)
    assert first.num_prompt_tokens == 7 and first.num_generation_tokens == 1
    assert first.num_tokens == 8
    assert first.time_to_first_tokens == [1.0] and first.inter_token_latencies == []
    second = table.iteration([out("r")], [], ARRIVAL + 1.3, T0 + 0.2)
    assert second.num_prompt_tokens == 0 and second.inter_token_latencies == [pytest.approx(0.2)]
    last = table.iteration(
        [out("r", finish_reason=FinishReason.LENGTH)], [], ARRIVAL + 1.6, T0 + 0.5
    )
    assert last.inter_token_latencies == [pytest.approx(0.3)]
    (done,) = last.finished_requests
    assert done.finish_reason == "length"
    assert done.e2e_latency == pytest.approx(1.6)
    assert (done.num_prompt_tokens, done.num_generation_tokens, done.max_tokens_param) == (7, 3, 3)
    assert done.queued_time == 0.5 and done.prefill_time == 0.25
    assert done.decode_time == pytest.approx(0.5)
    assert done.inference_time == pytest.approx(0.75)  # prefill + decode
    assert done.mean_time_per_output_token == pytest.approx(0.25)  # decode / (3 - 1)
    assert last.n_params == [1] and last.max_num_generation_tokens == [3]
    # Finished: later outputs of the same id (sent before an abort arrived) count no more.
    assert table.iteration([out("r")], [], ARRIVAL + 2, T0 + 1).num_tokens == 0


def test_n_and_the_longest_sample_are_observed_once_all_samples_finished() -> None:
    table = RequestStatsTable()
    table.add("p", ["0_p", "1_p"], ARRIVAL, num_prompt_tokens=4, max_tokens=10)
    it = table.iteration([out("0_p"), out("1_p")], [], ARRIVAL + 0.1, T0)
    assert it.num_prompt_tokens == 8  # each sample's prompt, as vLLM counts
    it = table.iteration([out("0_p", 2, finish_reason=FinishReason.STOP)], [], ARRIVAL + 1, T0 + 1)
    assert len(it.finished_requests) == 1 and it.n_params == []
    # A stop string found by the front end ends a sample too (finish reason "stop").
    it = table.iteration([out("1_p", 4)], ["1_p"], ARRIVAL + 2, T0 + 2)
    assert [f.finish_reason for f in it.finished_requests] == ["stop"]
    assert it.n_params == [2] and it.max_num_generation_tokens == [5]


def test_a_request_that_ends_before_its_first_token_has_no_phases() -> None:
    table = RequestStatsTable()
    table.add("r", ["r"], ARRIVAL, num_prompt_tokens=3, max_tokens=None)
    it = table.iteration([out("r", 0, finish_reason=FinishReason.ABORT)], [], ARRIVAL + 2, T0)
    (done,) = it.finished_requests
    assert done.finish_reason == "abort" and done.e2e_latency == 2.0
    assert done.num_generation_tokens == 0 and done.queued_time is None
    assert done.decode_time is None and done.mean_time_per_output_token is None


def test_forgotten_and_unknown_requests_are_ignored() -> None:
    table = RequestStatsTable()
    table.add("r", ["r"], ARRIVAL, num_prompt_tokens=3, max_tokens=5)
    table.forget("r")
    it = table.iteration([out("r"), out("other")], [], ARRIVAL + 1, T0)
    assert it.num_tokens == 0 and it.finished_requests == []


def test_one_token_requests_have_no_time_per_output_token() -> None:
    table = RequestStatsTable()
    table.add("r", ["r"], ARRIVAL, num_prompt_tokens=3, max_tokens=1)
    stats = table._by_child["r"]
    table.iteration(
        [out("r", queue_time=0.1, prefill_time=0.2, finish_reason=FinishReason.LENGTH)],
        [],
        ARRIVAL + 1,
        T0,
    )
    done = finished_request_stats(stats, "length", ARRIVAL + 1)
    assert done.decode_time == 0.0 and done.mean_time_per_output_token == 0.0
    assert done.inference_time == pytest.approx(0.2)


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
