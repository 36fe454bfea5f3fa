"""NumpySampler against Sampler: the same processed logits, greedy tokens, logprobs, seeded
streams, seeded draws (all but the rare draw that float rounding moves across a step),
speculative verification, grammar masks (numpy and C) and infill, on the same logits."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_sampler import CPU, infill_of, make_row, probs_of

from treadle.model import cpu_kernels
from treadle.model.kernel_lib import open_library
from treadle.wire.engine import Logprobs
from treadle.worker import np_sampler
from treadle.worker.np_sampler import Draws, NumpySampler
from treadle.worker.sampler import Sampler, _apply_grammar, infill_probs
from treadle.worker.sampling_rows import SamplingRow

Pair = tuple[SamplingRow, SamplingRow]  # (Sampler's row, NumpySampler's)
Sampled = tuple[list[int], list[Logprobs | None]]


def pair(seed: int | None = None, **changes: object) -> Pair:
    """One request's row for each sampler: torch tensors and a torch.Generator for Sampler,
    numpy arrays and `Draws` of the same seed for NumpySampler."""
    rows = make_row(generator=None if seed is None else torch.Generator().manual_seed(seed))
    rows = dataclasses.replace(rows, **changes)  # type: ignore[arg-type]
    as_numpy = dataclasses.replace(
        rows,
        generator=None if seed is None else Draws(seed),
        logit_bias=None if rows.logit_bias is None else tuple(v.numpy() for v in rows.logit_bias),
        allowed_token_ids=None
        if rows.allowed_token_ids is None
        else rows.allowed_token_ids.numpy(),
    )
    return rows, as_numpy


def logits_of(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


def both(
    x: np.ndarray,
    pairs: list[Pair],
    grammar: tuple[np.ndarray, np.ndarray] | None = None,
    seed: int = 0,
    lib: object = None,
) -> tuple[Sampled, Sampled, np.ndarray, np.ndarray]:
    """Each sampler's (tokens, logprobs) on its own copy of x, and the copies after (both
    process the logits in place)."""
    t_logits, n_logits = torch.from_numpy(x.copy()), x.copy()
    t_grammar = None if grammar is None else tuple(torch.from_numpy(a) for a in grammar)
    got_t = Sampler(seed, CPU)(t_logits, [p[0] for p in pairs], t_grammar)  # type: ignore[arg-type]
    got_n = NumpySampler(seed, lib)(n_logits, [p[1] for p in pairs], grammar)  # type: ignore[arg-type]
    return got_t, got_n, t_logits.numpy(), n_logits


def test_the_module_imports_no_torch() -> None:
    code = "import sys, treadle.worker.np_sampler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31 + 5, 2**40 + 7, -1, -(2**63), 2**63 - 1])
def test_draws_are_torch_s_uniforms(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    expected = [torch.rand(1, generator=generator).item() for _ in range(1000)]
    draws = Draws(seed)
    assert [draws.uniform() for _ in range(1000)] == expected
    skipped = Draws(seed, skip=300)  # a resumed request's stream (ModelRunner._generator)
    assert [skipped.uniform() for _ in range(700)] == expected[300:]


def test_greedy_is_the_first_argmax_and_leaves_unchanged_rows_alone() -> None:
    rng = np.random.default_rng(1)
    ties = rng.integers(0, 4, (64, 49152)).astype(np.float32)
    odd = rng.standard_normal((3, 49152)).astype(np.float32)
    odd[0, 100], odd[0, 50] = np.nan, np.nan
    odd[1, :], odd[1, 7] = -np.inf, 0.0
    for x in (ties, odd, logits_of(5, 1000)):
        before = x.copy()
        tokens, logprobs = NumpySampler(0)(x, [make_row(temperature=0.0)] * len(x), None)
        assert tokens == torch.from_numpy(x).max(dim=-1).indices.tolist()
        assert logprobs == [None] * len(x)
        np.testing.assert_array_equal(x, before)


def test_other_dtypes_are_converted_and_left_as_they_were() -> None:
    x = logits_of(2, 100).astype(np.float16)
    before = x.copy()
    rows = [make_row(temperature=0.0, banned_token_ids=[int(np.argmax(x[0]))])] * 2
    tokens, _ = NumpySampler(0)(x, rows)
    assert tokens[0] != np.argmax(x[0])
    np.testing.assert_array_equal(x, before)


OPTIONS: dict[str, dict[str, object]] = {
    "repetition": dict(repetition_penalty=1.3),
    "presence": dict(presence_penalty=0.5),
    "frequency": dict(frequency_penalty=0.7),
    "presence_and_frequency": dict(presence_penalty=0.4, frequency_penalty=0.3),
    "logit_bias": dict(logit_bias=(torch.tensor([3, 50, 999]), torch.tensor([5.0, -2.5, 100.0]))),
    "allowed_token_ids": dict(allowed_token_ids=torch.tensor([0, 17, 500, 999])),
    "bad_words": dict(bad_words_token_ids=[[7], [4, 9], [1, 2, 11]]),
    "min_tokens_bans": dict(banned_token_ids=[0, 1, 2]),
    "everything": dict(
        repetition_penalty=0.8,
        presence_penalty=-0.5,
        frequency_penalty=0.2,
        logit_bias=(torch.tensor([3]), torch.tensor([-1.0])),
        bad_words_token_ids=[[4, 9]],
        banned_token_ids=[5],
    ),
}


@pytest.mark.parametrize("option", OPTIONS)
def test_each_processing_option_gives_torch_s_logits_and_tokens(option: str) -> None:
    x = logits_of(6, 1000, seed=2)
    rng = np.random.default_rng(3)
    pairs = []
    for i in range(6):
        seen = dict(
            prompt_token_ids=rng.integers(0, 1000, 20).tolist(),
            output_token_ids=[*rng.integers(0, 20, 30).tolist(), 1, 2, 4],
        )
        pairs.append(pair(temperature=0.0, **seen, **(OPTIONS[option] if i % 3 else {})))
    (tokens_t, _), (tokens_n, _), processed_t, processed_n = both(x, pairs)
    np.testing.assert_array_equal(processed_n, processed_t)
    assert tokens_n == tokens_t


@pytest.mark.parametrize("vocab", [32, 49152])
def test_logprobs_are_torch_s_raw_logprobs_with_the_same_ranks_and_top_ids(vocab: int) -> None:
    x = logits_of(4, vocab, seed=4)
    bias = (torch.tensor([2]), torch.tensor([100.0]))
    pairs = [
        pair(temperature=0.0, logprobs=3),
        pair(temperature=0.0, logprobs=0, logit_bias=bias),  # a token of a low raw rank
        pair(logprobs=None),
        pair(seed=7, logprobs=min(20, vocab), top_k=10),
    ]
    (tokens_t, lps_t), (tokens_n, lps_n), _, _ = both(x, pairs)
    assert tokens_n == tokens_t and lps_n[2] is None and lps_t[2] is None
    for a, b in zip(lps_t, lps_n, strict=True):
        if a is None or b is None:
            continue
        assert b.token_ids == a.token_ids and b.ranks == a.ranks
        np.testing.assert_allclose(b.logprobs, a.logprobs, rtol=1e-5, atol=1e-5)
    assert lps_n[1] is not None and lps_n[1].ranks[0] > 1


SETTINGS: list[dict[str, object]] = [
    dict(),
    dict(temperature=0.7),
    dict(top_k=40),
    dict(top_p=0.9),
    dict(temperature=0.8, top_p=0.95),
    dict(min_p=0.05),
    dict(temperature=1.3, top_k=50, top_p=0.9, min_p=0.02),
    dict(temperature=2.0, top_p=0.5, repetition_penalty=1.2, banned_token_ids=[0]),
]


def test_seeded_sampling_draws_torch_s_tokens() -> None:
    """Each setting on many random rows, three steps each, every row with its own seed: the
    same tokens as Sampler's but for a draw that the samplers' float rounding moves across
    a step of the cdf (measured: 0 of 1,440 here at vocab 8,192; 1 of 1,440 at 49,152)."""
    rng = np.random.default_rng(5)
    same = total = 0
    for trial in range(60):
        x = logits_of(len(SETTINGS), 8192, seed=trial, scale=float(rng.choice([1.0, 3.0, 6.0])))
        seed = int(rng.integers(0, 2**32))
        pairs = [pair(seed=seed + i, **s) for i, s in enumerate(SETTINGS)]
        for _ in range(3):
            (tokens_t, _), (tokens_n, _), _, _ = both(x, pairs)
            same += sum(a == b for a, b in zip(tokens_t, tokens_n, strict=True))
            total += len(SETTINGS)
    assert same >= 0.995 * total, f"{same} of {total}"


@pytest.mark.parametrize("n", [40, 5000, 49152])
def test_the_blockwise_search_finds_torch_s_step_of_the_cdf(n: int) -> None:
    """`_first_past` against PyTorch's cumulative sum and searchsorted, zeros (min-p's) and
    the smallest and largest draws included."""
    rng = np.random.default_rng(n)
    probs = rng.exponential(size=n).astype(np.float32) ** 4
    probs[rng.random(n) < 0.3] = 0.0
    probs /= probs.sum()
    cdf = torch.from_numpy(probs).cumsum(0)
    for u in [0.0, 1 - 2**-24, *(rng.integers(0, 2**24, 500) * 2**-24)]:
        target = torch.tensor([u], dtype=torch.float32) * cdf[-1:]
        expected = int(torch.searchsorted(cdf, target, right=True))
        assert np_sampler._first_past(probs, np.float32(u)) == expected


def test_unseeded_rows_draw_from_the_sampler_s_own_stream() -> None:
    x = logits_of(3, 64, seed=6, scale=1.0)
    pairs = [pair(), pair(top_k=5), pair(temperature=0.0)]
    sampler_t, sampler_n = Sampler(11, CPU), NumpySampler(11)
    rows_t, rows_n = [p[0] for p in pairs], [p[1] for p in pairs]
    for _ in range(30):
        tokens_t, _ = sampler_t(torch.from_numpy(x.copy()), rows_t)
        assert sampler_n(x.copy(), rows_n)[0] == tokens_t


def test_draws_at_either_end_of_the_vocabulary() -> None:
    """The only possible token first or last: never one of probability 0 (`Sampler`'s clamp)."""
    x = logits_of(1, 32, seed=7)
    for only in (0, 31):
        row = pair(allowed_token_ids=torch.tensor([only]))[1]
        sampler = NumpySampler(0)
        assert {sampler(x.copy(), [row])[0][0] for _ in range(50)} == {only}


def test_verify_accepts_and_draws_as_the_torch_sampler() -> None:
    """Greedy: accepted while the argmax; seeded temperature > 0: the same draws per
    position, so the same verdicts (and logprobs of all the tokens given)."""
    rng = np.random.default_rng(8)
    requests = 40
    x = logits_of(3 * requests, 256, seed=9, scale=2.0)
    greedy = np.argmax(x, axis=-1)
    proposals, pairs = [], []
    for r in range(requests):
        # the argmax at the first position, so that some proposals are accepted
        proposals.append([int(greedy[3 * r]), int(rng.integers(0, 256))])
        settings = dict(temperature=0.0) if r % 2 else dict(top_k=int(rng.integers(0, 5)))
        p = pair(seed=100 + r, logprobs=2 if r % 4 == 0 else None, **settings)
        pairs += [p] * 3
    expected = Sampler(0, CPU).verify(torch.from_numpy(x.copy()), [p[0] for p in pairs], proposals)
    got = NumpySampler(0).verify(x.copy(), [p[1] for p in pairs], proposals)
    assert [v[:2] for v in got] == [v[:2] for v in expected]
    assert any(v[0] for v in got)  # some proposals accepted
    for (_, _, a), (_, _, b) in zip(expected, got, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert b.token_ids == a.token_ids and b.ranks == a.ranks
            np.testing.assert_allclose(b.logprobs, a.logprobs, rtol=1e-5, atol=1e-5)


def _library() -> object:
    kernels = cpu_kernels.load()
    return None if kernels is None else open_library(kernels.isa, kernels.path)


LIBRARY = _library()
MASKS = [None] + ([LIBRARY] if LIBRARY is not None else [])


@pytest.mark.parametrize("lib", MASKS, ids=["numpy", "C"][: len(MASKS)])
@pytest.mark.parametrize("vocab", [32, 1000, 49152])
def test_grammar_masks_as_the_torch_sampler(lib: object, vocab: int) -> None:
    """Words all clear, all set and mixed, a mask narrower than the vocabulary, and a row
    whose allowed tokens were banned already: the constraint alone decides there.
    (Without `lib` on a machine that builds no C kernels: the numpy mask only.)"""
    rng = np.random.default_rng(vocab)
    n_rows, words = 5, max(1, vocab // 32 - 2)
    kind = rng.integers(0, 3, (n_rows, words))
    mixed = rng.integers(-(2**31), 2**31, (n_rows, words))
    mask = np.where(kind == 0, 0, np.where(kind == 1, -1, mixed)).astype(np.int32)
    mask[4], mask[4, 0] = 0, 1 << 5  # token 5 only
    x = logits_of(7, vocab, seed=10)
    pairs = [pair(temperature=0.0)] * 7
    pairs[6] = pair(temperature=0.0, banned_token_ids=[5])  # ... and the grammar allows only 5
    rows = np.array([0, 2, 3, 5, 6])
    (tokens_t, _), (tokens_n, _), processed_t, processed_n = both(x, pairs, (rows, mask), lib=lib)
    np.testing.assert_array_equal(processed_n, processed_t)
    assert tokens_n == tokens_t and tokens_n[6] == 5
    expected = torch.from_numpy(x.copy())  # and the mask function alone, on all of its rows
    _apply_grammar(expected, torch.from_numpy(rows), torch.from_numpy(mask))
    got = x.copy()
    np_sampler.apply_grammar(got, rows, mask)
    np.testing.assert_array_equal(got, expected.numpy())


def test_infill_keeps_what_the_torch_infill_sampler_keeps() -> None:
    texts = {1: "return", 2: "ret", 3: "x", 4: "yield", 5: "r"}
    infill = infill_of(texts, end_ids={9}, eot=9)
    cases = [
        {1: 0.4, 2: 0.3, 3: 0.2, 4: 0.1},
        {1: 0.45, 2: 0.40, 9: 0.15},
        {1: 0.3, 3: 0.35, 4: 0.3, 5: 0.05},
        {i: 1 / 14 for i in range(10, 24)},
    ]
    for case in cases:
        probs = probs_of(case)
        ids, kept = np_sampler.infill_probs(None, probs.numpy(), infill)
        dense = np.zeros(len(probs), dtype=np.float32)
        dense[ids] = kept
        np.testing.assert_allclose(dense, infill_probs(probs, infill).numpy(), atol=1e-6)
    x = np.full((2, 32), -30.0, dtype=np.float32)
    x[:, [1, 2, 3, 4]] = np.log([0.4, 0.3, 0.2, 0.1])
    pairs = [pair(seed=3, infill=infill), pair(seed=4, top_k=3, infill=infill)]
    for _ in range(5):
        (tokens_t, _), (tokens_n, _), _, _ = both(x, pairs)
        assert tokens_n == tokens_t == [1, 1]
