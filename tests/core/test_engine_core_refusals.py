"""`EngineCore.add_request` never raises for what a client sent: a request it cannot run is
answered, for its client alone, with a finished-with-error output, and the engine keeps
serving. The same requests, once past the front end, used to crash the sampler."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from treadle import LLM, SamplingParams
from treadle.wire.engine import EngineCoreOutput, EngineCoreRequest, FinishReason

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(inprocess_llm: Callable[..., LLM]) -> LLM:
    return inprocess_llm(max_model_len=64)


def _bad(**changes: object) -> SamplingParams:
    """Params changed after construction, as a client could send them (skipping the checks
    of `SamplingParams.__post_init__`)."""
    params = SamplingParams(max_tokens=4)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


BAD_REQUESTS = {
    "logprobs": ([1, 2], _bad(logprobs=100_000), None),
    "top_k": ([1, 2], _bad(top_k=2**63, temperature=1.0), None),
    "stop_token_ids": ([1, 2], _bad(stop_token_ids=[1_000_000], min_tokens=2), None),
    "temperature": ([1, 2], _bad(temperature=float("inf")), None),
    "prompt": ([1, 10**9], SamplingParams(max_tokens=4), None),
    "eos_token_id": ([1, 2], SamplingParams(max_tokens=4, min_tokens=2), 10**6),
}


def test_each_bad_request_finishes_with_an_error_and_the_engine_goes_on(llm: LLM) -> None:
    core = llm.engine_core
    expected = llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    ids = llm.get_tokenizer()("Hello").input_ids
    for i, (field, (prompt, params, eos)) in enumerate(BAD_REQUESTS.items()):
        bad = EngineCoreRequest(f"bad{i}", prompt, params, eos_token_id=eos, client_index=1)
        good = EngineCoreRequest(f"good{i}", list(ids), GREEDY, eos_token_id=2)
        core.add_request(bad)  # must not raise
        core.add_request(good)
        assert core.has_unfinished_requests()
        refused: list[EngineCoreOutput] = []
        tokens: list[int] = []
        while core.has_unfinished_requests():
            per_client = core.step()
            refused += per_client[1].outputs if 1 in per_client else []
            for out in per_client[0].outputs if 0 in per_client else []:
                tokens += out.new_token_ids
        assert [(o.request_id, o.finish_reason) for o in refused] == [
            (f"bad{i}", FinishReason.ERROR)
        ]
        assert isinstance(refused[0].stop_reason, str) and field in refused[0].stop_reason
        assert tokens == expected, field


def test_a_duplicate_request_id_is_refused_without_touching_the_running_one(llm: LLM) -> None:
    core = llm.engine_core
    ids = llm.get_tokenizer()("Hello").input_ids
    core.add_request(EngineCoreRequest("dup", list(ids), GREEDY))
    core.add_request(EngineCoreRequest("dup", list(ids), GREEDY))
    outs: list[EngineCoreOutput] = []
    while core.has_unfinished_requests():
        outs += core.step()[0].outputs
    errors = [o for o in outs if o.finish_reason is FinishReason.ERROR]
    assert len(errors) == 1 and "already running" in str(errors[0].stop_reason)
    assert sum(len(o.new_token_ids) for o in outs) == 4  # the first one ran to its end


def test_refuse_answers_a_request_that_could_not_be_decoded(llm: LLM) -> None:
    core = llm.engine_core
    core.refuse("undecodable", 2, "SamplingParams.top_k must be ...")
    assert core.has_unfinished_requests()
    [out] = core.step()[2].outputs
    assert (out.request_id, out.finish_reason) == ("undecodable", FinishReason.ERROR)
    assert not core.has_unfinished_requests() and core.step() == {}
