"""`Sampler.verify`, speculative decoding's check of proposals: greedy acceptance, rejection
sampling at temperature > 0 (each position's token follows plain sampling's distribution, by
chi-square on known distributions; a wrong acceptance rule is caught), penalties and
min_tokens per position, logprobs of the accepted tokens, seeded draws."""

from __future__ import annotations

import pytest
import torch
from test_sampler import CPU, make_row

from treadle.worker import sampler as sampler_module
from treadle.worker.sampler import Sampler
from treadle.worker.sampling_rows import SamplingRow


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value (categories with expected count >= 5)."""
    total = observed.sum()
    expected = expected_probs * total
    keep = expected >= 5
    # everything outside `keep` must be (almost) never seen
    stat = (((observed - expected) ** 2) / expected)[keep].sum()
    stat += observed[~keep].sum() * 100  # mass where none is expected fails the test
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2))


# Known distributions at three positions of one request; proposals [1, 2].
P = torch.tensor(
    [
        [0.05, 0.30, 0.25, 0.20, 0.15, 0.05],
        [0.10, 0.10, 0.40, 0.25, 0.10, 0.05],
        [0.30, 0.20, 0.10, 0.10, 0.20, 0.10],
    ]
)
PROPOSAL = [1, 2]
N = 6000


def verify_many(sampler: Sampler, rows: list[SamplingRow]) -> list[tuple[list[int], int]]:
    logits = P.log().repeat(N, 1)
    verdicts = sampler.verify(logits, rows * N, [PROPOSAL] * N)
    return [(accepted, token) for accepted, token, _ in verdicts]


def position_counts(verdicts: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """Per position j: counts of the token output there, among requests that reached it."""
    counts = [torch.zeros(6) for _ in range(3)]
    for accepted, token in verdicts:
        for j, t in enumerate([*accepted, token]):
            counts[j][t] += 1
    return counts


def test_rejection_sampling_keeps_each_position_s_distribution() -> None:
    rows = [make_row(generator=torch.Generator().manual_seed(0))]
    counts = position_counts(verify_many(Sampler(0, CPU), rows * 3))
    for j in range(3):
        assert chi_square_p(counts[j], P[j]) > 1e-3, (j, counts[j])
    # the expected numbers reach each position: N, N p0(1), N p0(1) p1(2)
    assert abs(counts[1].sum() - N * 0.30) < 4 * (N * 0.3 * 0.7) ** 0.5
    assert abs(counts[2].sum() - N * 0.12) < 4 * (N * 0.12 * 0.88) ** 0.5


def too_often(probs: torch.Tensor, cdf: torch.Tensor, target: torch.Tensor, x: int | None) -> int:
    """A wrong rule: the proposal accepted when the draw falls under 1.2 p(x)."""
    if x is not None and float(target) < 1.2 * float(probs[x]) * float(cdf[-1]):
        return x
    return sampler_module._inverse_transform(probs, cdf, target)


def no_residual(probs: torch.Tensor, cdf: torch.Tensor, target: torch.Tensor, x: int | None) -> int:
    """A wrong rule: accepted with p(x), but on rejection drawn again from all of p, x too
    (the residual not renormalised without x)."""
    if x is not None and float(target) < float(probs[x]) * float(cdf[-1]):
        return x
    again = torch.rand(1) * cdf[-1:]
    return sampler_module._inverse_transform(probs, cdf, again)


@pytest.mark.parametrize("wrong", [too_often, no_residual])
def test_a_wrong_acceptance_rule_is_caught(wrong: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chi-square above has power: x accepted 20% too often, or the rejected x drawn
    again, gives p-values far under the 1e-3 the right rule passes."""
    monkeypatch.setattr(sampler_module, "_draw", wrong)
    torch.manual_seed(0)
    rows = [make_row(generator=torch.Generator().manual_seed(0))]
    counts = position_counts(verify_many(Sampler(0, CPU), rows * 3))
    assert chi_square_p(counts[0], P[0]) < 1e-6


def test_a_seeded_request_draws_plain_sampling_s_tokens() -> None:
    """The same seed, the same tokens as plain sampling, one per step, whatever is proposed:
    the draws are plain sampling's, the proposal only decides how many positions one step
    settles."""
    logits = P.log()
    plain_generator = torch.Generator().manual_seed(5)
    plain_rows = [make_row(generator=plain_generator)]
    spec_generator = torch.Generator().manual_seed(5)
    spec_rows = [make_row(generator=spec_generator)] * 3
    plain: list[int] = []
    spec: list[int] = []
    while len(spec) < 200:
        accepted, token, _ = Sampler(1, CPU).verify(logits, spec_rows, [PROPOSAL])[0]
        for j, t in enumerate([*accepted, token]):
            spec.append(t)
            plain.append(Sampler(2, CPU)(logits[j : j + 1].clone(), plain_rows)[0][0])
    assert spec == plain


def test_greedy_accepts_while_the_argmax_agrees() -> None:
    logits = P.log()
    rows = [make_row(temperature=0.0)] * 3
    assert Sampler(0, CPU).verify(logits, rows, [[1, 2]])[0][:2] == ([1, 2], 0)
    assert Sampler(0, CPU).verify(logits, rows, [[1, 3]])[0][:2] == ([1], 2)
    assert Sampler(0, CPU).verify(logits, rows, [[2, 2]])[0][:2] == ([], 1)


def test_a_proposal_outside_top_k_is_never_accepted() -> None:
    rows = [make_row(top_k=2)] * 3  # position 0 keeps tokens 1 and 2 only
    verdicts = Sampler(0, CPU).verify(P.log().repeat(200, 1), rows * 200, [[3, 2]] * 200)
    assert all(accepted == [] and token in (1, 2) for accepted, token, _ in verdicts)


def test_penalties_and_min_tokens_see_the_proposals_before_each_position() -> None:
    """Position j is processed after the first j proposals: a huge presence penalty on a
    proposed token makes it lose at the next position; min_tokens bans eos until reached."""
    logits = torch.zeros(3, 6)
    logits[:, 4] = 5.0  # token 4 wins everywhere, unless penalized
    logits[:, 3] = 4.0
    rows = [
        make_row(temperature=0.0, presence_penalty=10.0, output_token_ids=[4][:j]) for j in range(3)
    ]
    assert Sampler(0, CPU).verify(logits, rows, [[4, 4]])[0][:2] == ([4], 3)
    eos = 5
    logits[:, eos] = 9.0
    rows = [make_row(temperature=0.0, banned_token_ids=[eos] if j < 1 else []) for j in range(3)]
    assert Sampler(0, CPU).verify(logits, rows, [[4, 5]])[0][:2] == ([4, 5], 5)


def test_logprobs_are_the_target_s_raw_ones_for_every_output_token() -> None:
    logits = P.log()
    rows = [make_row(temperature=0.0, logprobs=2)] * 3
    accepted, token, lp = Sampler(0, CPU).verify(logits, rows, [[1, 3]])[0]
    assert (accepted, token) == ([1], 2)
    assert lp is not None and [ids[0] for ids in lp.token_ids] == [1, 2]
    assert lp.logprobs[0][0] == pytest.approx(float(P[0, 1].log()), abs=1e-5)
    assert lp.logprobs[1][0] == pytest.approx(float(P[1, 2].log()), abs=1e-5)
    assert lp.ranks == [1, 1] and lp.token_ids[0][1:] == [1, 2]


def test_a_seed_repeats_its_verdicts_and_draws_one_uniform_per_output_token() -> None:
    def run(seed: int) -> tuple[list[tuple[list[int], int]], torch.Generator]:
        g = torch.Generator().manual_seed(seed)
        rows = [make_row(generator=g)] * 3
        out = []
        for _ in range(50):
            accepted, token, _ = Sampler(1, CPU).verify(P.log(), rows, [PROPOSAL])[0]
            out.append((accepted, token))
        return out, g

    first, g = run(7)
    assert run(7)[0] == first and run(8)[0] != first
    tokens = sum(len(a) + 1 for a, _ in first)
    plain = torch.Generator().manual_seed(7)
    for _ in range(tokens):
        torch.rand(1, generator=plain)
    assert torch.equal(g.get_state(), plain.get_state())
