"""`treadle.structured_outputs`: constraints to llguidance matchers (with the default model's
tokenizer), the compiled-grammar cache, and bitmasks to logit penalties."""

from __future__ import annotations

import json

import pytest
import torch

from treadle.sampling_params import StructuredOutputsParams
from treadle.structured_outputs import GrammarCompiler, fill_bitmask, token_penalty
from treadle.validation import InvalidRequest


@pytest.fixture(scope="module")
def compiler(default_model_path: str) -> GrammarCompiler:
    from treadle.config import resolve_model
    from treadle.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(default_model_path))
    return GrammarCompiler(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def _reference_penalty(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.full((bitmask.shape[0], vocab), float("-inf"))
    for r in range(bitmask.shape[0]):
        for t in range(min(vocab, bitmask.shape[1] * 32)):
            if (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = 0.0
    return out


@pytest.mark.parametrize("vocab", [70, 96, 130])  # inside the last word, exact, past the mask
def test_token_penalty_reads_every_bit_including_the_sign_bit(vocab: int) -> None:
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=gen)
    bitmask[0, 0] = -(2**31)  # only bit 31: token 31
    assert torch.equal(token_penalty(bitmask, vocab), _reference_penalty(bitmask, vocab))
    assert token_penalty(bitmask, vocab)[0, :32].eq(0).nonzero().flatten().tolist() == [31]


def _walk(matcher: object, compiler: GrammarCompiler, text: str) -> bool:
    ids = compiler.ll_tokenizer.tokenize_str(text)
    return all(matcher.consume_token(t) for t in ids)  # type: ignore[attr-defined]


def test_a_matcher_accepts_its_language_and_cached_copies_are_independent(
    compiler: GrammarCompiler,
) -> None:
    so = StructuredOutputsParams(choice=["yes", "no"])
    first, second = compiler.matcher(so), compiler.matcher(so)
    assert _walk(first, compiler, "yes") and first.is_accepting()
    assert not second.is_accepting()  # the first one's tokens did not reach the cached copy
    assert not _walk(second, compiler, "maybe")


def test_json_schema_matcher_allows_only_compact_json_of_the_schema(
    compiler: GrammarCompiler,
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for given in (schema, json.dumps(schema)):
        so = StructuredOutputsParams(json=given)
        assert _walk(compiler.matcher(so), compiler, '{"n":12}')
        assert not _walk(compiler.matcher(so), compiler, '{"n":"x"}')


def test_the_bitmask_is_an_int32_array_with_llguidance_torchs_bits(
    compiler: GrammarCompiler,
) -> None:
    """`fill_bitmask` fills a numpy array (the engine core needs no torch) with the bits that
    `llguidance.torch` gave, speculated rows included; the matchers are left as they were."""
    import llguidance.torch
    import numpy as np

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    matchers = [compiler.matcher(StructuredOutputsParams(json=schema)) for _ in range(2)]
    ahead = [[], compiler.ll_tokenizer.tokenize_str('{"n":1')]
    mask = fill_bitmask(matchers, compiler.vocab_size, ahead)
    assert mask.dtype == np.int32 and mask.shape == (
        1 + 1 + len(ahead[1]),
        (compiler.vocab_size + 31) // 32,
    )
    want = llguidance.torch.allocate_token_bitmask(mask.shape[0], compiler.vocab_size)
    llguidance.torch.fill_next_token_bitmask(matchers[0], want, 0)
    llguidance.torch.fill_next_token_bitmask(matchers[1], want, 1)
    for i, token in enumerate(ahead[1], 2):
        assert matchers[1].consume_token(token)
        llguidance.torch.fill_next_token_bitmask(matchers[1], want, i)
    assert np.array_equal(mask, want.numpy())
    assert not np.array_equal(mask[1], mask[2])
    penalty = token_penalty(torch.from_numpy(mask), compiler.vocab_size)
    assert torch.equal(penalty, token_penalty(want, compiler.vocab_size))


@pytest.mark.parametrize(
    ("so", "param"),
    [
        (StructuredOutputsParams(regex="(a"), "structured_outputs.regex"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "structured_outputs.json"),
        (StructuredOutputsParams(grammar="start: (("), "structured_outputs.grammar"),
        (
            StructuredOutputsParams(structural_tag='{"structures": []}'),
            "structured_outputs.structural_tag",
        ),
    ],
)
def test_a_constraint_that_does_not_compile_names_its_field(
    compiler: GrammarCompiler, so: StructuredOutputsParams, param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        compiler.check(so)
    assert info.value.param == param
