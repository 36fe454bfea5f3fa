"""Sampler: greedy, temperature, top-k/top-p/min-p, seeds, penalties, banned ids, logprobs."""

import pytest
import torch

from treadle.model import cpu_kernels
from treadle.worker.sampler import Sampler, _apply_grammar, argmax_rows, infill_probs
from treadle.worker.sampling_rows import Infill, SamplingRow, TokenPieces

VOCAB = 32
CPU = torch.device("cpu")


def make_row(**changes: object) -> SamplingRow:
    fields: dict[str, object] = dict(
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logprobs=None,
        prompt_token_ids=[0],
        output_token_ids=[],
        banned_token_ids=[],
        generator=None,
    )
    fields.update(changes)
    return SamplingRow(**fields)  # type: ignore[arg-type]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=seeded(seed)) * 3


def sample(logits: torch.Tensor, rows: list[SamplingRow], seed: int = 0) -> list[int]:
    tokens, _ = Sampler(seed, CPU)(logits.clone(), rows)
    return tokens


def draws(logits: torch.Tensor, row: SamplingRow, n: int = 200) -> list[int]:
    """n draws of one row from one sampler, as n decode steps would give them."""
    sampler = Sampler(0, CPU)
    return [sampler(logits.clone(), [row])[0][0] for _ in range(n)]


def test_greedy_is_argmax_per_row():
    logits = random_logits(4)
    assert sample(logits, [make_row(temperature=0.0)] * 4) == logits.argmax(-1).tolist()


def test_argmax_rows_takes_the_first_of_equal_maxima_and_a_nan_as_pytorch_does():
    """The greedy pick (NumPy's argmax on the CPU) is `max(dim=-1).indices` on ties, -inf rows
    (a grammar's masked tokens), NaN and non-contiguous rows."""
    ties = torch.randint(0, 4, (64, 49152), generator=seeded(1)).float()
    odd = torch.randn(3, 49152, generator=seeded(2))
    odd[0, 100], odd[0, 50] = float("nan"), float("nan")
    odd[1, :] = float("-inf")
    odd[1, 7] = 0.0
    odd[2, 9] = float("inf")
    wide = torch.randn(4, 2 * VOCAB, generator=seeded(3))[:, ::2]
    for logits in (ties, odd, wide, random_logits(5)):
        got = argmax_rows(logits)
        assert got.dtype == torch.int64
        assert got.tolist() == logits.max(dim=-1).indices.tolist()
    assert argmax_rows(odd).tolist() == [50, 7, 9]


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = random_logits(6)
    greedy = logits.argmax(-1).tolist()
    for seed in range(5):
        assert sample(logits, [make_row(top_k=1)] * 6, seed) == greedy
        assert sample(logits, [make_row(top_p=1e-6)] * 6, seed) == greedy
        assert sample(logits, [make_row(min_p=1.0)] * 6, seed) == greedy


def test_tiny_temperature_is_greedy():
    logits = random_logits(4)
    assert sample(logits, [make_row(temperature=1e-4)] * 4) == logits.argmax(-1).tolist()


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-9] * (VOCAB - 3)]))
    counts = torch.bincount(torch.tensor(draws(logits, make_row(), 500)), minlength=VOCAB)
    assert counts[3:].sum() == 0
    assert 300 < counts[0] < 400 and 60 < counts[1] < 140 and 20 < counts[2] < 80


def test_a_draw_never_lands_on_a_zero_probability_token_at_either_end():
    """The inverse-transform draw at the edges of the cdf: the only possible token is the first
    or the last of the vocabulary, and every other one has probability 0."""
    logits = random_logits(1)
    for only in (0, VOCAB - 1):
        row = make_row(allowed_token_ids=torch.tensor([only]))
        assert set(draws(logits, row, 50)) == {only}


def test_tokens_outside_top_k_never_appear():
    logits = random_logits(1)
    top3 = set(logits[0].topk(3).indices.tolist())
    got = draws(logits, make_row(top_k=3, temperature=2.0))
    assert set(got) <= top3 and len(set(got)) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4)])
    logits = torch.log(probs.clamp_min(1e-12))
    assert set(draws(logits, make_row(top_p=0.75))) == {0, 1}  # 0.5 < 0.75 <= 0.8
    assert set(draws(logits, make_row(top_p=0.5))) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4)])
    logits = torch.log(probs.clamp_min(1e-12))
    assert set(draws(logits, make_row(min_p=0.4))) == {0, 1}  # 0.15 < 0.4 * 0.5


def test_top_k_and_top_p_apply_per_row():
    logits = random_logits(1).repeat(2, 1)
    rows = [make_row(top_k=1), make_row(temperature=5.0)]
    sampler = Sampler(0, CPU)
    second = {sampler(logits.clone(), rows)[0][1] for _ in range(100)}
    assert len(second) > 5  # the unrestricted row still spreads out


def test_same_seed_gives_the_same_tokens_whatever_the_batch():
    logits = random_logits(3)
    alone = Sampler(1, CPU)
    batched = Sampler(2, CPU)
    gen_alone, gen_batched = seeded(42), seeded(42)
    for _ in range(20):
        [a], _ = alone(logits[1:2].clone(), [make_row(generator=gen_alone)])
        rows = [make_row(), make_row(generator=gen_batched), make_row(temperature=0.0, top_k=4)]
        b = batched(logits.clone(), rows)[0][1]
        assert a == b


def test_different_seeds_differ_and_unseeded_rows_use_the_sampler_seed():
    logits = torch.zeros(1, VOCAB)
    assert draws(logits, make_row(generator=seeded(1)), 20) != draws(
        logits, make_row(generator=seeded(2)), 20
    )
    assert sample(logits, [make_row()], seed=5) == sample(logits, [make_row()], seed=5)
    assert len({sample(logits, [make_row()], seed=s)[0] for s in range(20)}) > 1


def test_banned_ids_are_never_sampled():
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 50.0
    rows = [make_row(temperature=0.0, banned_token_ids=[3]), make_row(banned_token_ids=[3, 4])]
    sampler = Sampler(0, CPU)
    for _ in range(50):
        tokens, _ = sampler(logits.clone(), rows)
        assert 3 not in tokens and tokens[1] != 4


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 1.9, -1.5] + [-10.0] * (VOCAB - 4)])
    row = make_row(temperature=0.0, repetition_penalty=2.0, prompt_token_ids=[0], logprobs=0)
    assert sample(logits, [row]) == [2]  # 2.0 / 2 < 1.9
    logits = torch.tensor([[-1.0, -1.2] + [-10.0] * (VOCAB - 2)])
    row = make_row(temperature=0.0, repetition_penalty=1.5, output_token_ids=[0])
    assert sample(logits, [row]) == [1]  # -1.0 * 1.5 < -1.2


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([[3.0, 2.5, 2.0] + [0.0] * (VOCAB - 3)])
    greedy = dict(temperature=0.0, prompt_token_ids=[0, 0, 0])
    assert sample(logits, [make_row(presence_penalty=1.0, **greedy)]) == [0]
    assert sample(logits, [make_row(presence_penalty=0.6, output_token_ids=[0], **greedy)]) == [1]
    # frequency scales with the count: 3.0 - 2 * 0.2 > 2.5, but 3.0 - 3 * 0.2 < 2.5
    twice = make_row(frequency_penalty=0.2, output_token_ids=[0, 0], **greedy)
    thrice = make_row(frequency_penalty=0.2, output_token_ids=[0, 0, 0], **greedy)
    assert sample(logits, [twice]) == [0] and sample(logits, [thrice]) == [1]


def test_penalties_apply_only_to_their_row():
    logits = random_logits(1).repeat(2, 1)
    top = int(logits[0].argmax())
    rows = [
        make_row(
            temperature=0.0,
            presence_penalty=2.0,
            frequency_penalty=2.0,
            repetition_penalty=10.0,
            output_token_ids=[top] * 5,
        ),
        make_row(temperature=0.0),
    ]
    tokens = sample(logits, rows)
    assert tokens[0] != top and tokens[1] == top


def test_logprobs_are_raw_with_rank_and_top_n():
    logits = random_logits(2)
    rows = [make_row(temperature=0.0, logprobs=3), make_row(logprobs=None)]
    tokens, logprobs = Sampler(0, CPU)(logits.clone(), rows)
    assert logprobs[1] is None
    lp = logprobs[0]
    assert lp is not None
    expected = torch.log_softmax(logits[0], -1)
    [ids], [values] = lp.token_ids, lp.logprobs
    assert ids[0] == tokens[0] and lp.ranks == [1]
    assert ids[1:] == expected.topk(3).indices.tolist()
    assert values == pytest.approx([expected[i].item() for i in ids], abs=1e-5)


def test_logprob_rank_of_a_non_top_token_and_zero_top_n():
    logits = torch.tensor([[3.0, 2.0, 1.0] + [-20.0] * (VOCAB - 3)])
    row = make_row(temperature=0.0, logprobs=0, banned_token_ids=[0, 1])
    tokens, [lp] = Sampler(0, CPU)(logits.clone(), [row])
    assert tokens == [2] and lp is not None
    assert lp.token_ids == [[2]] and lp.ranks == [3]  # ranked by the raw logits
    assert lp.logprobs[0][0] == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())


def test_half_precision_logits_are_accepted():
    logits = random_logits(2).to(torch.bfloat16)
    assert sample(logits, [make_row(temperature=0.0)] * 2) == logits.float().argmax(-1).tolist()


def test_repetition_penalty_with_nothing_seen_is_a_no_op():
    logits = random_logits(1)
    row = make_row(temperature=0.0, repetition_penalty=1.3, prompt_token_ids=[])
    assert sample(logits, [row]) == logits.argmax(-1).tolist()


# -- logit_bias, allowed_token_ids, bad_words, structured-output bitmask ----------------------


def test_logit_bias_minus_100_removes_a_token_and_plus_100_forces_one():
    logits = random_logits(1)
    top = int(logits.argmax())
    ban = make_row(temperature=0.0, logit_bias=(torch.tensor([top]), torch.tensor([-100.0])))
    assert sample(logits, [ban]) != [top]
    force = make_row(logit_bias=(torch.tensor([7]), torch.tensor([100.0])))
    assert all(sample(logits, [force], seed) == [7] for seed in range(5))


def test_allowed_token_ids_only_those_are_drawn():
    logits = random_logits(1)
    row = make_row(allowed_token_ids=torch.tensor([3, 9, 30]))
    assert set(draws(logits, row, 100)) <= {3, 9, 30}


def test_bad_words_ban_a_word_s_last_token_after_its_prefix():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 10.0  # greedy picks 5 ...
    single = make_row(temperature=0.0, bad_words_token_ids=[[5]])
    assert sample(logits, [single]) != [5]
    # ... and a two-token word [4, 5] bans 5 only right after 4
    after = make_row(temperature=0.0, output_token_ids=[1, 4], bad_words_token_ids=[[4, 5]])
    elsewhere = make_row(temperature=0.0, output_token_ids=[4, 1], bad_words_token_ids=[[4, 5]])
    assert sample(logits.repeat(2, 1), [after, elsewhere]) == [sample(logits, [single])[0], 5]


def _bitmask(allowed: list[list[int]]) -> torch.Tensor:
    words = (VOCAB + 31) // 32
    mask = torch.zeros(len(allowed), words, dtype=torch.int64)
    for i, ids in enumerate(allowed):
        for t in ids:
            mask[i, t // 32] |= 1 << (t % 32)
    return mask.to(torch.int32)  # wraps bit 31 to the sign bit, as llguidance's int32 masks


# The grammar mask on PyTorch (None) and on the C kernel of every ISA level this CPU runs.
MASK_BACKENDS = [None] + (cpu_kernels.available_isas() if cpu_kernels.load() is not None else [])


def _kernels(isa: str | None) -> cpu_kernels.Kernels | None:
    return None if isa is None else cpu_kernels.kernels_for(isa)


@pytest.mark.parametrize("isa", MASK_BACKENDS)
def test_grammar_bitmask_applies_to_its_rows_only(isa: str | None):
    logits = random_logits(3)
    logits[1] = 0.0  # uniform: an unconstrained row shows many tokens over 30 seeds
    rows = [make_row()] * 3
    grammar = (torch.tensor([0, 2]), _bitmask([[31], [4, 17]]))
    kernels = _kernels(isa)
    for seed in range(10):
        tokens, _ = Sampler(seed, CPU, kernels)(logits.clone(), rows, grammar)
        assert tokens[0] == 31 and tokens[2] in (4, 17)
    free = {Sampler(seed, CPU, kernels)(logits.clone(), rows, grammar)[0][1] for seed in range(30)}
    assert len(free) > 2  # the unconstrained row still samples freely


@pytest.mark.parametrize("isa", MASK_BACKENDS)
def test_grammar_wins_when_other_bans_leave_no_token(isa: str | None):
    logits = random_logits(1)
    row = make_row(temperature=0.0, banned_token_ids=[6])  # min_tokens bans EOS, say 6 ...
    sampler = Sampler(0, CPU, _kernels(isa))
    tokens, _ = sampler(logits.clone(), [row], (torch.tensor([0]), _bitmask([[6]])))
    assert tokens == [6]  # ... but the grammar is complete and allows only EOS


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler (or TREADLE_CPU_KERNELS=0)")
@pytest.mark.parametrize("isa", MASK_BACKENDS[1:])
@pytest.mark.parametrize("vocab", [1000, 1024, 49152])
def test_the_bitmask_kernel_matches_the_pytorch_path(isa: str, vocab: int):
    """Words all clear, all set and mixed; a mask narrower than the vocabulary; strided rows
    (every other row of a wider tensor); and a row whose allowed tokens were banned already."""
    gen = seeded(vocab)
    n_rows, words = 7, vocab // 32 - 2  # the last 64+ tokens are past the mask: never allowed
    kind = torch.randint(0, 3, (n_rows, words), generator=gen)
    mixed = torch.randint(-(2**31), 2**31, (n_rows, words), generator=gen, dtype=torch.int64)
    mask = torch.where(kind == 0, 0, torch.where(kind == 1, -1, mixed)).to(torch.int32)
    wide = torch.randn(2 * n_rows + 1, vocab, generator=gen)
    wide[:, ::5] = float("-inf")  # earlier bans (min_tokens, bad words, ...)
    wide[6] = float("-inf")  # row 3 of the view below: no token left before the mask
    rows = torch.tensor([0, 2, 3, 5, 6])
    before = wide.clone()
    expected = wide[::2].clone()
    _apply_grammar(expected, rows, mask[: len(rows)])
    got = wide[::2]  # a strided view, masked in place
    cpu_kernels.kernels_for(isa).apply_token_bitmask_(got, rows, mask[: len(rows)])
    assert torch.equal(got, expected)
    assert torch.equal(wide[1::2], before[1::2])  # rows outside the view untouched
    assert bool((got[3] == 0).any()) and bool(torch.isinf(got[3]).any())


def test_logprobs_are_the_raw_distribution_s_before_bias_and_masks():
    logits = random_logits(1)
    raw = torch.log_softmax(logits[0], -1)
    row = make_row(
        temperature=0.0,
        logprobs=0,
        logit_bias=(torch.tensor([2]), torch.tensor([100.0])),
    )
    tokens, lps = Sampler(0, CPU)(logits.clone(), [row])
    assert tokens == [2] and lps[0] is not None
    assert lps[0].logprobs[0][0] == pytest.approx(float(raw[2]))
    assert lps[0].ranks[0] == int((raw > raw[2]).sum()) + 1


# -- llama.cpp's infill sampler ------------------------------------------------------------


def infill_of(texts: dict[int, str], end_ids: set[int], eot: int = 0) -> Infill:
    """An `Infill` whose token texts are `texts` (others: empty, as special tokens)."""

    class FakeTokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return texts.get(ids[0], "")

    return Infill(frozenset(end_ids), eot, TokenPieces(lambda: FakeTokenizer()))


def probs_of(values: dict[int, float]) -> torch.Tensor:
    p = torch.zeros(VOCAB)
    for token, v in values.items():
        p[token] = v
    return p


def test_infill_ends_when_end_of_generation_is_likely_enough() -> None:
    # 3 * p_end * n = 3 * 0.15 * 3 = 1.35 > p_text = 0.85: only the end remains;
    # 3 * 0.05 * 3 = 0.45 < 0.95: the text tokens stay
    infill = infill_of({1: "a", 2: "b"}, end_ids={5})
    out = infill_probs(probs_of({1: 0.45, 2: 0.40, 5: 0.15}), infill)
    assert out[5] == 1.0 and out.sum() == 1.0
    out = infill_probs(probs_of({1: 0.50, 2: 0.45, 5: 0.05}), infill)
    assert out[5] < 1.0


def test_infill_merges_tokens_whose_text_starts_another_and_drops_the_unlikely() -> None:
    # "ret" starts "return": the likelier one ("return") takes the other's probability; 0.1 goes
    texts = {1: "return", 2: "ret", 3: "x", 4: "yield"}
    infill = infill_of(texts, end_ids={9})
    out = infill_probs(probs_of({1: 0.4, 2: 0.3, 3: 0.2, 4: 0.1}), infill)
    assert out[2] == 0 and out[4] == 0
    # after the merge: return 0.7, x 0.2 (both >= 0.2), then the 1 / (2 + 1) cut drops x
    assert out[1] == pytest.approx(1.0)


def test_infill_with_nothing_likely_left_ends_with_eot() -> None:
    texts = {i: f"t{i}" for i in range(1, 8)}
    texts.update({i: f"u{i}" for i in range(8, 15)})
    infill = infill_of(texts, end_ids={20}, eot=20)
    out = infill_probs(probs_of({i: 1 / 14 for i in range(1, 15)}), infill)
    assert out[20] == 1.0


def test_infill_rows_sample_only_what_the_infill_sampler_keeps() -> None:
    texts = {1: "return", 2: "ret", 3: "x", 4: "yield"}
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, [1, 2, 3, 4]] = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    row = make_row(infill=infill_of(texts, end_ids={9}))
    assert set(draws(logits, row, 50)) == {1}
    assert len(set(draws(logits, make_row(), 200))) > 1  # without it: all four come up
