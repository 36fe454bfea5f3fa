"""The one set of request rules (`treadle.validation`): what each field may hold, and that
every failure names its field."""

from __future__ import annotations

import math

import msgspec
import pytest

from treadle.sampling_params import SamplingParams
from treadle.validation import (
    MAX_N,
    MAX_STOP,
    InvalidRequest,
    ModelLimits,
    check_max_tokens,
    check_prompt,
    check_request,
    parse_int,
)
from treadle.wire.engine import EngineCoreRequest, add_request_identity

LIMITS = ModelLimits(vocab_size=1000, max_model_len=64, max_logprobs=20)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 2**63),
        ("top_k", 2**64),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("n", 0),
        ("n", MAX_N + 1),
        ("max_tokens", 2**64),
        ("min_tokens", 2**63),
        ("logprobs", 2**63),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("top_p", math.nan),
        ("min_p", math.inf),
        ("presence_penalty", math.inf),
        ("frequency_penalty", -math.inf),
        ("repetition_penalty", math.inf),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [2**63]),
        ("stop_token_ids", [1] * (MAX_STOP + 1)),
        ("stop", ["x"] * (MAX_STOP + 1)),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest, match=rf"^SamplingParams\.{field} ") as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert info.value.param == field
    assert info.value.message.startswith(f"{field} ")  # what an HTTP client reads


def test_extremes_that_are_valid_pass() -> None:
    p = SamplingParams(
        n=MAX_N,
        top_k=2**63 - 1,
        seed=2**63 - MAX_N,  # seed + i for each of the n samples stays an int64
        max_tokens=2**63 - 1,
        min_tokens=2**63 - 1,
        temperature=1e300,
        repetition_penalty=1e300,
    )
    assert p.top_k == 2**63 - 1
    with pytest.raises(InvalidRequest, match="seed"):
        SamplingParams(n=2, seed=2**63 - 1)


def test_a_tiny_temperature_is_raised_as_vllm_does() -> None:
    assert SamplingParams(temperature=1e-9).temperature == 0.01
    assert SamplingParams(temperature=0.0).greedy


def test_check_request_against_the_model() -> None:
    ok = SamplingParams(logprobs=20, stop_token_ids=[999])
    check_request([1, 2, 3], ok, LIMITS, eos_token_id=2, priority=-(2**63))
    cases: list[tuple[list[int], SamplingParams, dict[str, int], str]] = [
        ([], ok, {}, "prompt"),
        ([1] * 64, ok, {}, "prompt"),
        ([1000], ok, {}, "prompt"),
        ([-1], ok, {}, "prompt"),
        ([1], SamplingParams(logprobs=21), {}, "logprobs"),
        ([1], SamplingParams(stop_token_ids=[1000], min_tokens=2), {}, "stop_token_ids"),
        ([1], ok, {"eos_token_id": 1000}, "eos_token_id"),
        ([1], ok, {"priority": 2**63}, "priority"),
    ]
    for ids, params, extra, field in cases:
        with pytest.raises(InvalidRequest) as info:
            check_request(ids, params, LIMITS, **extra)  # type: ignore[arg-type]
        assert info.value.param == field, (ids, params, extra)


def test_logprobs_are_capped_by_the_vocabulary_too() -> None:
    small = ModelLimits(vocab_size=10, max_model_len=64, max_logprobs=100)
    with pytest.raises(InvalidRequest, match=r"\(10; see --max-logprobs\)"):
        check_request([1], SamplingParams(logprobs=11), small)


def test_check_request_rechecks_params_changed_after_construction() -> None:
    """The engine core must not rely on `__post_init__`: a struct can be changed later."""
    p = SamplingParams()
    p.top_k = 2**64
    with pytest.raises(InvalidRequest, match="top_k"):
        check_request([1], p, LIMITS)


def test_max_tokens_must_fit_the_context() -> None:
    check_max_tokens(54, 10, LIMITS)
    with pytest.raises(InvalidRequest, match="maximum context length is 64") as info:
        check_max_tokens(55, 10, LIMITS)
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequest, match="shorten the prompt"):
        check_prompt(list(range(64)), LIMITS)


def test_renamed_gives_the_clients_field_name() -> None:
    e = InvalidRequest("logprobs", "is too big", where="SamplingParams.")
    assert str(e) == "SamplingParams.logprobs is too big"
    assert e.renamed({"logprobs": "top_logprobs"}).message == "top_logprobs is too big"
    assert e.renamed({"other": "x"}) is e


def test_an_undecodable_add_still_names_its_request() -> None:
    p = SamplingParams()
    p.top_k = 2**63  # encodes (msgpack goes to 2**64 - 1), but does not decode
    payload = msgspec.msgpack.encode(EngineCoreRequest("r1", [1], p, client_index=3))
    with pytest.raises(msgspec.ValidationError, match="top_k"):
        msgspec.msgpack.decode(payload, type=EngineCoreRequest)
    assert add_request_identity(payload) == ("r1", 3)
    default_client = msgspec.msgpack.encode(EngineCoreRequest("r2", [1], SamplingParams()))
    assert add_request_identity(default_client) == ("r2", 0)
    assert add_request_identity(b"\xc1") is None
    assert add_request_identity(msgspec.msgpack.encode([1, 2])) is None


# -- integers written in strings (headers, logit_bias keys) ---------------------------------------


@pytest.mark.parametrize(
    "text",
    ["²", "٣", "1e3", " 1", "1 ", "+1", "1_0", "-0", "-1", "", "0x1", "1\n", "１", "9" * 5000],
)
def test_parse_int_takes_ascii_digits_only(text: str) -> None:
    """`isdigit()` takes "²" (then `int()` raises: a 500 once), `int()` takes "٣", " 1", "+1",
    "1_0" and "１": each is a 400 naming the field, as is a number past the bounds."""
    with pytest.raises(InvalidRequest) as e:
        parse_int(text, "X-data-parallel-rank", 0, 3)
    assert e.value.param == "X-data-parallel-rank" and len(e.value.message) < 200


def test_parse_int_bounds_and_sign() -> None:
    assert parse_int("0", "p", 0, 3) == 0 and parse_int("3", "p", 0, 3) == 3
    assert parse_int("007", "p", 0, 10) == 7
    assert parse_int("-5", "p") == -5 and parse_int("-0", "p") == 0  # a sign where one may be
    assert parse_int(str(2**63 - 1), "p") == 2**63 - 1
    for text in ("4", "99999999999999999999", str(2**63)):
        with pytest.raises(InvalidRequest, match=r"must be an integer in \[0, 3\]"):
            parse_int(text, "p", 0, 3)
    with pytest.raises(InvalidRequest):
        parse_int(str(2**63), "p")
