"""`InFlight`: what a front end resumes after an engine death, and the dead-letter rule."""

from treadle.frontend.inflight import InFlight
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
)

PARAMS = SamplingParams(max_tokens=10, seed=3, temperature=0.5)


def request(rid: str, arrival: float) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], PARAMS, eos_token_id=2, arrival_time=arrival)


def outputs(engine: int, *outs: EngineCoreOutput) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=engine, outputs=list(outs))


def test_a_resumed_request_carries_what_its_client_received() -> None:
    inflight = InFlight()
    inflight.add(request("a", 1.0), engine=0)
    lp = Logprobs([[5], [6]], [[-0.1], [-0.2]], [1, 1])
    inflight.on_outputs(outputs(0, EngineCoreOutput("a", [7], new_prompt_logprobs=lp)))
    inflight.on_outputs(outputs(0, EngineCoreOutput("a", [8, 9])))
    resumed = inflight.resumed("a")
    assert resumed is not None
    assert resumed.resumed_output_token_ids == [7, 8, 9]
    assert resumed.resumed_prompt_logprobs == 2
    assert (resumed.prompt_token_ids, resumed.sampling_params) == ([1, 2, 3], PARAMS)
    assert resumed.arrival_time == 1.0 and resumed.eos_token_id == 2


def test_finished_and_aborted_requests_are_forgotten() -> None:
    inflight = InFlight()
    inflight.add(request("a", 1.0), engine=0)
    inflight.add(request("b", 2.0), engine=0)
    progressed = inflight.on_outputs(
        outputs(0, EngineCoreOutput("a", [], finish_reason=FinishReason.STOP))
    )
    assert progressed == ["a"] and inflight.resumed("a") is None
    inflight.remove(["b"])
    assert inflight.count(0) == 0 and inflight.on_engine_death(0) == ([], [])


def test_only_the_dead_engine_s_requests_resume_in_arrival_order() -> None:
    inflight = InFlight()
    inflight.add(request("late", 3.0), engine=0)
    inflight.add(request("other", 1.0), engine=1)
    inflight.add(request("early", 2.0), engine=0)
    assert inflight.on_engine_death(0) == (["early", "late"], [])
    assert inflight.count(1) == 1


def test_in_flight_at_two_deaths_without_progress_is_failed() -> None:
    inflight = InFlight()
    for rid, t in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        inflight.add(request(rid, t), engine=0)
    assert inflight.on_engine_death(0) == (["a", "b", "c"], [])
    # resumed one at a time: a makes progress on the new engine, b is in flight without any,
    # c was not sent again yet when the engine dies a second time
    assert inflight.resumed("a") is not None and inflight.resumed("b") is not None
    inflight.on_outputs(outputs(0, EngineCoreOutput("a", [4])))
    resume, fail = inflight.on_engine_death(0)
    assert resume == ["a", "c"] and fail == ["b"]
    assert inflight.resumed("b") is None  # failed ones are forgotten
    assert inflight.resumed("c") is not None
    # a's progress reset its count: a third death is its second suspicion only; c, in flight
    # at its second death without progress, fails
    assert inflight.resumed("a") is not None
    inflight.on_outputs(outputs(0, EngineCoreOutput("a", [5])))
    assert inflight.on_engine_death(0) == (["a"], ["c"])
