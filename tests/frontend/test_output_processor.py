"""OutputProcessor: token deltas -> RequestOutputs, n > 1 merging, stop strings -> aborts."""

from typing import Any

import pytest

from treadle.config import resolve_model
from treadle.frontend.output_processor import OutputProcessor, child_params, child_request_ids
from treadle.outputs import Logprob
from treadle.sampling_params import SamplingParams
from treadle.tokenizer import load_tokenizer
from treadle.wire.engine import EngineCoreOutput, FinishReason, Logprobs

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(resolve_model(None))


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def core_output(rid: str, tokens: list[int], **kw: Any) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=rid, new_token_ids=tokens, **kw)


def test_child_ids_and_params():
    assert child_request_ids("x", 1) == ["x"]
    assert child_request_ids("x", 3) == ["0_x", "1_x", "2_x"]
    single = SamplingParams(seed=5)
    assert child_params(single, 0) is single
    params = SamplingParams(n=3, seed=5, temperature=0.7)
    children = [child_params(params, i) for i in range(3)]
    assert [(c.n, c.seed, c.temperature) for c in children] == [
        (1, 5, 0.7),
        (1, 6, 0.7),
        (1, 7, 0.7),
    ]
    assert child_params(SamplingParams(n=2), 1).seed is None


def test_single_request_streams_then_finishes(tok):
    proc = OutputProcessor(tok)
    assert proc.add_request("r", "hi", PROMPT, SamplingParams()) == ["r"]
    ids = encode(tok, "Hello world")
    [out], abort = proc.process_outputs([core_output("r", ids[:1], num_cached_tokens=2)])
    assert abort == [] and not out.finished and out.outputs[0].text == "Hello"
    assert (out.request_id, out.prompt, out.prompt_token_ids) == ("r", "hi", PROMPT)
    final = core_output("r", ids[1:], finish_reason=FinishReason.LENGTH)
    [out], _ = proc.process_outputs([final])
    comp = out.outputs[0]
    assert out.finished and out.num_cached_tokens == 2
    assert (comp.text, comp.token_ids, comp.finish_reason) == ("Hello world", ids, "length")
    assert comp.logprobs is None and comp.cumulative_logprob is None
    assert not proc.has_unfinished()
    assert proc.process_outputs([core_output("r", ids[:1])]) == ([], [])  # late output


def test_stop_token_finish_keeps_the_engine_reason(tok):
    proc = OutputProcessor(tok)
    proc.add_request("r", None, PROMPT, SamplingParams(stop_token_ids=[tok.eos_token_id]))
    eos = tok.eos_token_id
    out = core_output("r", [eos], finish_reason=FinishReason.STOP, stop_reason=eos)
    [res], abort = proc.process_outputs([out])
    assert abort == [] and res.finished
    assert (res.outputs[0].finish_reason, res.outputs[0].stop_reason) == ("stop", tok.eos_token_id)


def test_stop_string_finishes_and_asks_to_abort(tok):
    proc = OutputProcessor(tok)
    proc.add_request("r", None, PROMPT, SamplingParams(stop=["\n\n"]))
    [res], abort = proc.process_outputs([core_output("r", encode(tok, "Hi\n\nthere"))])
    comp = res.outputs[0]
    assert abort == ["r"] and res.finished and not proc.has_unfinished()
    assert (comp.text, comp.finish_reason, comp.stop_reason) == ("Hi", "stop", "\n\n")


def test_stop_string_on_the_engines_last_output_needs_no_abort(tok):
    proc = OutputProcessor(tok)
    proc.add_request("r", None, PROMPT, SamplingParams(stop=["END"]))
    last = core_output("r", encode(tok, "the END"), finish_reason=FinishReason.LENGTH)
    [res], abort = proc.process_outputs([last])
    assert abort == [] and res.outputs[0].text == "the "
    assert (res.outputs[0].finish_reason, res.outputs[0].stop_reason) == ("stop", "END")


def test_n_children_merge_into_one_output(tok):
    proc = OutputProcessor(tok)
    ids = proc.add_request("r", None, PROMPT, SamplingParams(n=3, stop=["!"]))
    a, b, c = encode(tok, " a"), encode(tok, " b!"), encode(tok, " c")
    results, abort = proc.process_outputs(
        [core_output(ids[2], c), core_output(ids[0], a), core_output(ids[1], b)]
    )
    [res] = results
    assert abort == [ids[1]] and not res.finished
    assert [(o.index, o.text) for o in res.outputs] == [(0, " a"), (1, " b"), (2, " c")]
    assert res.outputs[1].finish_reason == "stop" and res.outputs[0].finish_reason is None
    # a finished child's late output is ignored; the parent finishes with its last child
    [res], _ = proc.process_outputs(
        [core_output(ids[1], a), core_output(ids[0], a, finish_reason=FinishReason.LENGTH)]
    )
    assert not res.finished and res.outputs[1].token_ids == b
    [res], _ = proc.process_outputs([core_output(ids[2], a, finish_reason=FinishReason.STOP)])
    assert res.finished and not proc.has_unfinished()
    assert [o.finish_reason for o in res.outputs] == ["length", "stop", "stop"]
    assert res.outputs[0].text == " a a"


def test_logprobs_accumulate(tok):
    proc = OutputProcessor(tok)
    proc.add_request("r", None, PROMPT, SamplingParams(logprobs=1))
    lp = Logprobs(token_ids=[[5, 6]], logprobs=[[-0.5, -0.25]], ranks=[2])
    proc.process_outputs([core_output("r", [5], new_logprobs=lp)])
    lp = Logprobs(token_ids=[[7, 7]], logprobs=[[-1.0, -1.0]], ranks=[1])
    [res], _ = proc.process_outputs([core_output("r", [7], new_logprobs=lp)])
    comp = res.outputs[0]
    text = tok.decode
    assert comp.logprobs == [
        {5: Logprob(-0.5, 2, text([5])), 6: Logprob(-0.25, 1, text([6]))},
        {7: Logprob(-1.0, 1, text([7]))},  # the sampled token is the top-1: one entry
    ]
    assert comp.cumulative_logprob == pytest.approx(-1.5)


def test_prompt_logprobs_start_with_none_and_fill_across_chunks(tok):
    proc = OutputProcessor(tok)
    prompt = [3, 4, 5, 6]
    ids = proc.add_request("r", None, prompt, SamplingParams(n=2, prompt_logprobs=0))
    chunk1 = Logprobs(token_ids=[[4], [5]], logprobs=[[-1.0], [-2.0]], ranks=[3, 1])
    [res], _ = proc.process_outputs([core_output(ids[0], [], new_prompt_logprobs=chunk1)])
    assert res.prompt_logprobs == [
        None,
        {4: Logprob(-1.0, 3, tok.decode([4]))},
        {5: Logprob(-2.0, 1, tok.decode([5]))},
    ]
    chunk2 = Logprobs(token_ids=[[6]], logprobs=[[-0.5]], ranks=[2])
    [res], _ = proc.process_outputs([core_output(ids[0], [9], new_prompt_logprobs=chunk2)])
    assert res.prompt_logprobs is not None and len(res.prompt_logprobs) == len(prompt)
    assert res.prompt_logprobs[3] == {6: Logprob(-0.5, 2, tok.decode([6]))}


def test_returned_outputs_are_snapshots(tok):
    proc = OutputProcessor(tok)
    proc.add_request("r", None, PROMPT, SamplingParams())
    [first], _ = proc.process_outputs([core_output("r", encode(tok, "one"))])
    proc.process_outputs([core_output("r", encode(tok, " two"))])
    assert first.outputs[0].text == "one" and first.outputs[0].token_ids == encode(tok, "one")


def test_abort_returns_child_ids_and_forgets(tok):
    proc = OutputProcessor(tok)
    ids = proc.add_request("r", None, PROMPT, SamplingParams(n=2))
    assert proc.abort("r") == ids and not proc.has_unfinished()
    assert proc.abort("r") == [] and proc.abort("never") == []
    assert proc.process_outputs([core_output(ids[0], [5])]) == ([], [])
