"""A request resumed on an engine core (`EngineCoreRequest.resumed_output_token_ids`: what its
client had received when the engine died) continues exactly as if nothing had happened: the
same greedy or seeded tokens, max_tokens and penalties counted over all outputs, a grammar
that has seen the earlier tokens. Bad resumed outputs are refused like any bad field."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from treadle import LLM, SamplingParams
from treadle.sampling_params import StructuredOutputsParams
from treadle.wire.engine import EngineCoreRequest, FinishReason


@pytest.fixture(scope="module")
def llm(inprocess_llm: Callable[..., LLM]) -> LLM:
    return inprocess_llm(max_model_len=128)


def run(llm: LLM, request: EngineCoreRequest) -> tuple[list[int], FinishReason | None, object]:
    """Step the engine until the request ends: (its new tokens, finish reason, stop reason)."""
    core = llm.engine_core
    core.add_request(request)
    tokens: list[int] = []
    while core.has_unfinished_requests():
        outputs = core.step().get(0)
        for out in outputs.outputs if outputs is not None else []:
            if out.request_id == request.request_id:
                tokens += out.new_token_ids
                if out.finished:
                    return tokens, out.finish_reason, out.stop_reason
    raise AssertionError("the request never finished")


PROMPT = [1, 17, 42, 99, 7, 3]
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
    "penalized": SamplingParams(
        temperature=0.8, seed=3, presence_penalty=1.5, frequency_penalty=0.5, max_tokens=24,
        ignore_eos=True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("cut", [1, 10, 23])
def test_a_resumed_request_continues_its_stream_exactly(llm: LLM, kind: str, cut: int) -> None:
    params = PARAMS[kind]
    whole, reason, _ = run(llm, EngineCoreRequest(f"{kind}-{cut}-a", PROMPT, params))
    assert len(whole) == 24 and reason is FinishReason.LENGTH
    resumed = EngineCoreRequest(
        f"{kind}-{cut}-b", PROMPT, params, resumed_output_token_ids=whole[:cut]
    )
    rest, reason, _ = run(llm, resumed)
    assert rest == whole[cut:]  # and so max_tokens counted the resumed outputs
    assert reason is FinishReason.LENGTH


def test_a_resumed_structured_request_keeps_its_grammar(llm: LLM) -> None:
    so = StructuredOutputsParams(choice=["alpha beta gamma", "alpha delta"])
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
    whole, reason, _ = run(llm, EngineCoreRequest("so-a", PROMPT, params, eos_token_id=2))
    assert reason is FinishReason.STOP and len(whole) >= 2
    resumed = EngineCoreRequest(
        "so-b", PROMPT, params, eos_token_id=2, resumed_output_token_ids=whole[:1]
    )
    rest, reason, _ = run(llm, resumed)
    assert rest == whole[1:] and reason is FinishReason.STOP
    # outputs the grammar cannot have produced are refused, not run
    wrong = whole[:1] + [t for t in range(50) if t not in whole][:3]
    bad = EngineCoreRequest("so-c", PROMPT, params, resumed_output_token_ids=wrong)
    tokens, reason, stop = run(llm, bad)
    assert tokens == [] and reason is FinishReason.ERROR and "grammar" in str(stop)


BAD_RESUMES = {
    "an id outside the vocabulary": [1, 10**9],
    "as many as max_tokens": [5] * 24,
    "past the context": [5] * 125,
}


@pytest.mark.parametrize("what", list(BAD_RESUMES))
def test_bad_resumed_outputs_are_refused(llm: LLM, what: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24 if "max" in what else 200)
    bad = EngineCoreRequest(
        f"bad-{what}", PROMPT, params, resumed_output_token_ids=BAD_RESUMES[what]
    )
    tokens, reason, stop = run(llm, bad)
    assert tokens == [] and reason is FinishReason.ERROR
    assert "resumed_output_token_ids" in str(stop)
