"""`InputProcessor.prepare`: one prompt's request truncated, checked once against the model and
fanned out into its `n` samples, for the HTTP server and the offline `LLM` alike."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import pytest

from treadle.frontend.input_processor import InputProcessor
from treadle.sampling_params import SamplingParams
from treadle.validation import InvalidRequest, ModelLimits

VOCAB, MAX_MODEL_LEN = 49152, 64


@cache
def _tokenizer() -> Any:
    from treadle.config import resolve_model
    from treadle.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


@pytest.fixture
def processor() -> InputProcessor:
    limits = ModelLimits(VOCAB, MAX_MODEL_LEN)
    return InputProcessor(_tokenizer(), limits, max_prompt_chars=10_000, client_index=2)


def test_prepare_truncates_and_drops_the_text_the_cut_no_longer_matches(
    processor: InputProcessor,
) -> None:
    params = SamplingParams(truncate_prompt_tokens=3)
    cut = processor.prepare("r", "some text", [5, 6, 7, 8, 9], params)
    assert cut.prompt_token_ids == [7, 8, 9] and cut.prompt is None
    assert [c.prompt_token_ids for c in cut.children] == [[7, 8, 9]]
    whole = processor.prepare("r", "some text", [7, 8, 9], params)
    assert whole.prompt_token_ids == [7, 8, 9] and whole.prompt == "some text"
    # A prompt longer than the context is taken once cut to fit (the check sees the cut).
    long = processor.prepare(
        "r", None, list(range(5, 105)), SamplingParams(truncate_prompt_tokens=10)
    )
    assert long.prompt_token_ids == list(range(95, 105))


def test_prepare_fans_out_n_samples(processor: InputProcessor) -> None:
    params = SamplingParams(n=3, seed=7, prompt_logprobs=1, max_tokens=5)
    request = processor.prepare("r", "hi", [1, 2, 3], params, priority=4)
    assert request.request_id == "r" and request.params is params
    children = request.children
    assert [c.request_id for c in children] == ["0_r", "1_r", "2_r"]
    assert [c.sampling_params.seed for c in children] == [7, 8, 9]
    # Only the first scores the prompt: its logprobs are the same for all.
    assert [c.sampling_params.prompt_logprobs for c in children] == [1, None, None]
    for child in children:
        assert child.sampling_params.n == 1 and child.sampling_params.max_tokens == 5
        assert child.prompt_token_ids == [1, 2, 3]
        assert (child.priority, child.client_index) == (4, 2)
        assert child.eos_token_id == processor.eos_token_id
    one = processor.prepare("s", "hi", [1, 2, 3], SamplingParams(seed=7))
    assert [c.request_id for c in one.children] == ["s"]
    assert one.children[0].sampling_params is one.params


def test_prepare_gives_bad_words_their_token_ids(processor: InputProcessor) -> None:
    request = processor.prepare("r", None, [1, 2], SamplingParams(n=2, bad_words=["cat"]))
    words = request.params.bad_words_token_ids
    assert words  # "cat" and " cat"
    assert all(c.sampling_params.bad_words_token_ids == words for c in request.children)


@pytest.mark.parametrize(
    ("prompt", "params", "priority", "param", "message"),
    [
        ([], SamplingParams(), 0, "prompt", "empty"),
        ([5] * MAX_MODEL_LEN, SamplingParams(), 0, "prompt", "maximum context length is 64"),
        ([5, VOCAB], SamplingParams(), 0, "prompt", "token ids in"),
        ([5], SamplingParams(logprobs=21), 0, "logprobs", "see --max-logprobs"),
        ([5], SamplingParams(prompt_logprobs=21), 0, "prompt_logprobs", "see --max-logprobs"),
        ([5], SamplingParams(stop_token_ids=[VOCAB]), 0, "stop_token_ids", str(VOCAB)),
        ([5], SamplingParams(logit_bias={VOCAB: 1.0}), 0, "logit_bias", str(VOCAB)),
        ([5], SamplingParams(allowed_token_ids=[VOCAB]), 0, "allowed_token_ids", str(VOCAB)),
        ([5], SamplingParams(), 2**63, "priority", "integer"),
    ],
)
def test_prepare_refuses_what_the_model_cannot_take(
    processor: InputProcessor,
    prompt: list[int],
    params: SamplingParams,
    priority: int,
    param: str,
    message: str,
) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        processor.prepare("r", None, prompt, params, priority)
    assert info.value.param == param


def test_prepare_checks_once_however_many_samples(
    processor: InputProcessor, check_request_calls: list[Sequence[int]]
) -> None:
    request = processor.prepare("r", None, [1, 2, 3, 4], SamplingParams(n=4, seed=1))
    assert len(request.children) == 4
    assert check_request_calls == [[1, 2, 3, 4]]
