"""Speculative decoding (issue 27): n-gram proposals (vLLM's `{"method": "ngram"}`; a draft
model's are `core/spec_draft.py`'s), and how many proposals one forward pass verifies.

Prompt lookup: the last n tokens of a request (n from `prompt_lookup_max` down to
`prompt_lookup_min`) are looked up in its earlier tokens (prompt and output), latest
occurrence first; the up to k tokens that followed it are the proposal. The scheduler gives
the request 1 + k positions in one step, which the model runner reads as 1 + k decode rows
(the fused decode path takes them) and verifies (`Sampler.verify`): greedily (the model's own
choice at each position, in order, until the first that differs: that choice is the bonus
token), so the output is exactly that of plain greedy decoding; at temperature > 0 by vLLM's
rejection sampling, so the output has exactly the distribution of plain sampling. Position j
is processed as plain sampling would after the first j proposals (penalties, `min_tokens`,
bad words see them); logprobs are the target model's. The positions past the first rejection
are given back (`Scheduler.update_from_output`).

How many proposals a step verifies follows what they are worth on this machine: the scheduler
times every step of decode rows (`StepTimes`, by its number of rows), and each request keeps
its recent acceptance rate a (per proposed token, decayed, starting at the engine's recent rate
over every request, `PRIOR_HITS / PRIOR_TRIALS` before any: cautiously). Its j-th proposal is
worth a^j tokens; `plan` takes proposals, the most valuable first (each worth at least
`MIN_WORTH` tokens), as far as gives the step the most expected tokens per second. So a request
whose proposals are mostly rejected proposes nothing, a middling one proposes fewer, and a
batch whose step time grows with every row (many requests on a small CPU) speculates only where
acceptance is high. Row counts never timed are assumed to cost what the nearest count below
costs (so they are tried once, and then known). With a draft model its forwards count in the
step's time too (the j-th proposals of m requests cost a draft forward of m requests, as the
draft has timed it), so a draft that costs more than its proposals save proposes nothing. A
request the plan leaves out proposes one token every `PROBE_EVERY` steps, so that its rate can
rise again, where a sure token would pay.

A request under a grammar (structured outputs) speculates too: its proposal is cut before the
first token the grammar would reject (`Scheduler._proposals`, llguidance's `validate_tokens`),
and the step's bitmask holds one row per position it verifies (the matcher advanced through
the proposals and rolled back, `GrammarMatchers.bitmask`), so each position is sampled as
plain decoding would sample it there. Pooling and infill requests do not speculate.
"""

from __future__ import annotations

import heapq

from treadle.config import SpeculativeConfig
from treadle.sampling_params import SamplingParams

PRIOR_HITS, PRIOR_TRIALS = 1.0, 2.0  # a request's acceptance rate before any proposal: 0.5
DECAY = 0.8  # per verifying step, the weight of what came before
ENGINE_DECAY = 0.98  # the same over every request's verifying steps: the engine's prior
PROBE_EVERY = 64
MIN_WORTH = 0.05
# Verifying proposals must promise this many times the tokens per second of a step without
# them: where they barely pay (a big batch on a small CPU, whose every row costs what an
# average one does) the estimates' noise would make them cost a little on average (the plan
# follows a step time measured low by chance) and a row count tried costs its trial.
MIN_GAIN = 1.03
TIME_DECAY = 0.75  # moving average of a row count's step time


def acceptance(hits: float, trials: float, prior: float | None = None) -> float:
    """A request's acceptance rate: its (decayed) hits over trials, with `PRIOR_TRIALS`
    trials at the rate `prior` (the engine's recent rate over every request: a new request of
    a workload whose proposals are mostly accepted starts high) before its own; without a
    prior, at `PRIOR_HITS / PRIOR_TRIALS`."""
    if prior is None:
        return (hits + PRIOR_HITS) / (trials + PRIOR_TRIALS)
    return (hits + PRIOR_TRIALS * prior) / (trials + PRIOR_TRIALS)


def tally(
    hits: float, trials: float, proposed: int, accepted: int, decay: float = DECAY
) -> tuple[float, float]:
    """(hits, trials) after a verifying step: each accepted proposal a hit, the first
    rejected one a miss; those after it were never tried."""
    tried = accepted + (accepted < proposed)
    return decay * hits + accepted, decay * trials + tried


class StepTimes:
    """Seconds a step of decode rows takes, by its number of rows (a moving average)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = (
            seconds if old is None else TIME_DECAY * old + (1 - TIME_DECAY) * seconds
        )

    def estimate(self, rows: int) -> float | None:
        """Measured; else interpolated between the nearest counts timed below and above;
        else the nearest below's (optimistic: it is then tried and timed) or above's; None
        before anything was timed."""
        values = self.table(rows, rows)
        return values[0] if values else None

    def table(self, first: int, last: int) -> list[float]:
        """`estimate(r)` for r in first..last in one pass (a plan reads dozens of them every
        step); [] before anything was timed. (What a subclass changes.)"""
        if not self.seconds:
            return []
        counts = sorted(self.seconds)
        out: list[float] = []
        i = 0  # counts[i] is the first count >= r
        for r in range(first, last + 1):
            while i < len(counts) and counts[i] < r:
                i += 1
            if i < len(counts) and counts[i] == r:
                out.append(self.seconds[r])
            elif i == 0:
                out.append(self.seconds[counts[0]])
            elif i == len(counts):
                out.append(self.seconds[counts[-1]])
            else:
                below, above = counts[i - 1], counts[i]
                lo, hi = self.seconds[below], self.seconds[above]
                out.append(lo + (hi - lo) * (r - below) / (above - below))
        return out


def plan(
    candidates: dict[str, tuple[int, float]],
    base_rows: int,
    times: StepTimes,
    draft: StepTimes | None = None,
) -> tuple[dict[str, int], bool]:
    """How many of its proposals each candidate (request id -> (proposals available, its
    acceptance rate)) verifies in a step of `base_rows` other decode rows; and whether a
    sure token would still have paid where the plan stopped (then probes are worth it).
    `draft`: a draft model's forward times, by its number of requests; the j-th proposals
    of the requests that make one cost a draft forward of that many requests, which counts
    in the step's time (a draft forward never timed costs nothing: it is tried, then known)."""
    base = times.estimate(base_rows)
    if base is None:  # nothing timed yet
        return {rid: most for rid, (most, _) in candidates.items()}, True
    est = times.table(base_rows, base_rows + sum(most for most, _ in candidates.values()) + 1)
    rows, tokens, seconds = base_rows, float(base_rows), base
    depths: list[int] = []  # requests making a j-th proposal, by j - 1
    drafting = 0.0  # the draft forwards' seconds

    def draft_cost(j: int) -> float:
        """The draft forwards' seconds with one more request making a j-th proposal."""
        if draft is None:
            return 0.0
        n = depths[j - 1] if j <= len(depths) else 0
        before = (draft.estimate(n) or 0.0) if n else 0.0
        return drafting + (draft.estimate(n + 1) or 0.0) - before

    def sure_pays() -> bool:
        """Whether one more row holding a sure token would raise the tokens per second."""
        sure = est[rows + 1 - base_rows]
        return (tokens + 1) * seconds >= tokens * (sure + draft_cost(1))

    heap = [(-a, rid, 1) for rid, (most, a) in candidates.items() if most > 0]
    heapq.heapify(heap)
    # Every proposal worth MIN_WORTH, the most valuable first; the plan is the prefix of them
    # with the most tokens per second. (Not the first prefix after which the rate falls:
    # step times are measured, so a count may cost more than the next one, and stopping at
    # the first dip would never try the rows past it again.)
    added: list[tuple[str, int]] = []
    best = (tokens / seconds, 0, sure_pays())
    floor = MIN_GAIN * best[0]  # what proposals must promise to be verified at all
    while heap and -heap[0][0] >= MIN_WORTH:
        worth, rid, j = heapq.heappop(heap)
        verify = est[rows + 1 - base_rows]
        with_draft = draft_cost(j)
        rows, tokens, seconds, drafting = rows + 1, tokens - worth, verify + with_draft, with_draft
        if j > len(depths):
            depths.append(0)
        depths[j - 1] += 1
        added.append((rid, j))
        if tokens / seconds > max(best[0], floor):
            best = (tokens / seconds, len(added), sure_pays())
        most, a = candidates[rid]
        if j < most:
            heapq.heappush(heap, (worth * a, rid, j + 1))
    if not heap and best[1] == len(added):
        return dict(added), True  # every proposal taken
    return dict(added[: best[1]]), best[2]


def can_speculate(p: SamplingParams) -> bool:
    return p.pooling is None and not p.infill


def propose(tokens: list[int], most: int, config: SpeculativeConfig) -> list[int]:
    """Up to `most` tokens that followed the latest earlier occurrence of the longest suffix
    of `tokens` (of `prompt_lookup_min`..`prompt_lookup_max` tokens) that occurred before."""
    if most <= 0:
        return []
    length = len(tokens)
    for n in range(min(config.prompt_lookup_max, length - 1), config.prompt_lookup_min - 1, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        for i in range(length - n - 1, -1, -1):
            if tokens[i] == first and tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + most]
    return []
