"""The engine core checks `prompt_embeds` again (its socket is untrusted, issue 23): without
--enable-prompt-embeds, or with a tensor the front end would have refused, the request ends
with an error naming `prompt_embeds` and the engine goes on serving."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from treadle import LLM, SamplingParams
from treadle.wire.engine import EngineCoreOutput, EngineCoreRequest, FinishReason

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
HIDDEN = 64


@pytest.fixture(scope="module")
def llm(inprocess_llm: Callable[..., LLM]) -> LLM:
    return inprocess_llm(max_model_len=64, enable_prompt_embeds=True)


def run(core: Any, requests: list[EngineCoreRequest]) -> list[EngineCoreOutput]:
    for request in requests:
        core.add_request(request)
    outs: list[EngineCoreOutput] = []
    while core.has_unfinished_requests():
        for client_outputs in core.step().values():
            outs += client_outputs.outputs
    return outs


def embeds_request(rid: str, embeds: torch.Tensor, rows: int | None = None, **kw: Any) -> Any:
    n = embeds.shape[0] if rows is None else rows
    return EngineCoreRequest(rid, [0] * n, kw.pop("params", GREEDY), prompt_embeds=embeds, **kw)


def test_without_the_flag_the_engine_refuses_embeddings(
    inprocess_llm: Callable[..., LLM],
) -> None:
    core = inprocess_llm(max_model_len=64).engine_core
    outs = run(core, [embeds_request("e", torch.randn(3, HIDDEN))])
    assert [o.finish_reason for o in outs] == [FinishReason.ERROR]
    assert "--enable-prompt-embeds" in str(outs[0].stop_reason)


@pytest.mark.parametrize(
    ("embeds", "rows", "params", "match"),
    [
        (torch.randn(3, HIDDEN), 4, GREEDY, "3 rows for 4 prompt tokens"),
        (torch.randn(3, HIDDEN + 1), None, GREEDY, "hidden size"),
        (torch.ones(3, HIDDEN, dtype=torch.float64), None, GREEDY, "float64"),
        (torch.full((3, HIDDEN), float("inf")), None, GREEDY, "infinite"),
        (torch.randn(HIDDEN, 3).t(), None, GREEDY, "contiguous"),
        (
            torch.randn(3, HIDDEN),
            None,
            SamplingParams(max_tokens=2, prompt_logprobs=0),
            "prompt_logprobs",
        ),
    ],
)
def test_a_bad_tensor_is_refused_and_the_engine_goes_on(
    llm: LLM,
    embeds: torch.Tensor,
    rows: int | None,
    params: SamplingParams,
    match: str,
) -> None:
    good = EngineCoreRequest("good", [1, 2, 3], GREEDY)
    outs = run(llm.engine_core, [embeds_request("bad", embeds, rows, params=params), good])
    bad = [o for o in outs if o.request_id == "bad"]
    assert [o.finish_reason for o in bad] == [FinishReason.ERROR]
    assert match in str(bad[0].stop_reason)
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "good") == 4


def test_a_resumed_embeddings_request_continues_exactly(llm: LLM) -> None:
    """A request resumed after its engine died carries its embeddings again (the front end
    re-sends the request it first sent, `frontend/inflight.py`) and continues its stream."""
    from treadle.frontend.inflight import InFlight

    embeds = torch.randn(20, HIDDEN) * 0.05
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = embeds_request("whole", embeds, params=params)
    whole = [t for o in run(llm.engine_core, [first]) for t in o.new_token_ids]
    assert len(whole) == 12
    inflight = InFlight()
    inflight.add(embeds_request("again", embeds, params=params), engine=0)
    inflight.requests["again"].output_token_ids = whole[:5]
    resumed = inflight.resumed("again")
    assert resumed is not None and resumed.prompt_embeds is not None
    rest = [t for o in run(llm.engine_core, [resumed]) for t in o.new_token_ids]
    assert rest == whole[5:]
