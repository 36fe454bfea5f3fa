"""The per-request timings of the metrics: queue, prefill, decode, inference, time per output
token, TTFT, ITL (vLLM's definitions), from engine outputs made up here."""

import pytest

from treadle.frontend.request_stats import RequestStatsTable, finished_request_stats
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
