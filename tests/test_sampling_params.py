"""SamplingParams: defaults, normalisation, and validation that names the bad field."""

import msgspec
import pytest

from treadle.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.greedy


def test_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(temperature=0.0).greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 2.5),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("stop", ["ok", ""]),
    ],
)
def test_bad_value_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_must_not_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens .*max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_boundary_values_are_accepted():
    p = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=0.01,
        max_tokens=1,
        logprobs=0,
    )
    assert p.top_k == 1 and p.logprobs == 0


def test_clone_changes_fields_and_validates():
    p = SamplingParams(n=3, seed=7)
    q = p.clone(n=1, seed=8)
    assert (q.n, q.seed, p.n, p.seed) == (1, 8, 3, 7)
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p"):
        p.clone(top_p=0.0)


def test_wire_round_trip_keeps_values_and_validates():
    p = SamplingParams(temperature=0.5, top_k=5, stop=["x"], stop_token_ids=[3], seed=1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    bad = msgspec.msgpack.encode(p).replace(
        msgspec.msgpack.encode(0.5), msgspec.msgpack.encode(-1.0)
    )
    with pytest.raises(msgspec.ValidationError, match=r"SamplingParams\.temperature"):
        msgspec.msgpack.decode(bad, type=SamplingParams)


def test_a_json_schema_with_numbers_past_64_bits_crosses_the_wire() -> None:
    """The fuzz test found it: a schema dict holding an int below -2**63 made msgpack raise
    OverflowError (a 500); the schema travels as its JSON text instead."""
    from treadle.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json={"": -(2**63) - 1})
    params = SamplingParams(structured_outputs=so)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert back.structured_outputs is not None
    assert back.structured_outputs.json == '{"": -9223372036854775809}'
