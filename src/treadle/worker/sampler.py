"""Batched sampling: penalties, logit_bias, allowed_token_ids, bad_words, min_tokens, the
structured-output bitmask, temperature, top-k/top-p/min-p, seeds, logprobs.

Logprobs are those of the model's raw distribution (vLLM's default `raw_logprobs`), before
any of the changes above. All rows are processed as one tensor; per-request settings become per-row tensors. A request
with a `seed` draws its noise from its own generator, one draw per step, so its tokens do
not depend on what else is in the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from treadle.model.cpu_kernels import Kernels
from treadle.structured_outputs import token_penalty
from treadle.wire.engine import Logprobs
from treadle.worker.sampling_rows import (
    INFILL_MAX_CANDIDATES,
    Infill,
    SamplingRow,
    greedy_verdict,
    infill_keep,
)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first of equal ones; of a NaN, the first
    NaN), as `logits.max(dim=-1).indices` gives. On the CPU NumPy's vectorized argmax: ~3 us
    a row of the default model's 49,152 logits against PyTorch's ~27 (one thread), a
    single stream's step being ~3.5 ms."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1))
    return logits.max(dim=-1).indices


def infill_probs(probs: torch.Tensor, infill: Infill) -> torch.Tensor:
    """llama.cpp's `infill` sampler (`sampling_rows.infill_keep`) on one row of probabilities
    (after top-k/top-p/min-p), among its `INFILL_MAX_CANDIDATES` most likely tokens."""
    nonzero = (probs > 0).nonzero().squeeze(1)
    if nonzero.numel() > INFILL_MAX_CANDIDATES:
        nonzero = nonzero[probs[nonzero].topk(INFILL_MAX_CANDIDATES).indices]
    values = probs[nonzero]
    order = values.argsort(descending=True)
    total = float(values.sum())
    kept = infill_keep(nonzero[order].tolist(), [v / total for v in values[order].tolist()], infill)
    out = torch.zeros_like(probs)
    for token, p in kept.items():
        out[token] = p
    return out


class Sampler:
    def __init__(self, seed: int, device: torch.device, kernels: Kernels | None = None) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.kernels = kernels  # the model's C kernels (CPU, float32), or None: PyTorch

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[list[int], list[Logprobs | None]]:
        """`grammar`: (indices of rows under a structured-output constraint, their int32
        token bitmask rows)."""
        logits = logits.float()
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(r.logprobs is not None for r in rows) else None
        )
        logits = self._apply_penalties(logits, rows)
        for i, row in enumerate(rows):
            _restrict(logits, i, row)
        if grammar is not None:
            self._apply_grammar(logits, grammar)
        tokens = self._sample(logits, rows).tolist()
        if raw_logprobs is None:
            return tokens, [None] * len(rows)
        return tokens, [
            None if row.logprobs is None else _logprobs(raw_logprobs[i], tokens[i], row.logprobs)
            for i, row in enumerate(rows)
        ]

    def _apply_grammar(
        self, logits: torch.Tensor, grammar: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        rows_idx, bitmask = grammar
        if self.kernels is not None and logits.device.type == "cpu":
            self.kernels.apply_token_bitmask_(logits, rows_idx, bitmask)
        else:
            _apply_grammar(logits, rows_idx, bitmask)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            if row.repetition_penalty != 1.0:
                seen = torch.tensor(
                    sorted(set(row.prompt_token_ids + row.output_token_ids)),
                    dtype=torch.long,
                    device=logits.device,
                )
                values = logits[i, seen]
                logits[i, seen] = torch.where(
                    values > 0, values / row.repetition_penalty, values * row.repetition_penalty
                )
            if (row.presence_penalty or row.frequency_penalty) and row.output_token_ids:
                counts = torch.bincount(
                    torch.tensor(row.output_token_ids, device=logits.device),
                    minlength=logits.shape[1],
                ).to(logits.dtype)
                logits[i] -= row.frequency_penalty * counts + row.presence_penalty * (counts > 0)
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = argmax_rows(logits)
        random_rows = [i for i, r in enumerate(rows) if r.temperature > 0.0]
        if not random_rows:
            return greedy
        device = logits.device
        idx = torch.tensor(random_rows, device=device)
        sub = [rows[i] for i in random_rows]
        probs = _probs(logits[idx], sub)
        # Inverse transform: one uniform draw per row from the row's own generator, and the
        # first token whose cumulative probability exceeds it. (An exponential race, argmax of
        # p / E, needs a draw per vocabulary entry: ~1.1 ms a row on the CPU, 70 ms a step at
        # 64 rows; this is ~0.05 ms a row.)
        u = torch.cat([torch.rand(1, generator=r.generator or self.generator) for r in sub])
        cdf = probs.cumsum(dim=-1)
        target = (u.to(device) * cdf[:, -1])[:, None]
        sampled = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1)
        # A zero-probability token only where float rounding took the draw past the last
        # step of the cdf: then the most likely token.
        zero = probs.gather(1, sampled) <= 0
        if bool(zero.any()):
            sampled = torch.where(zero, probs.argmax(dim=-1, keepdim=True), sampled)
        greedy[idx] = sampled.squeeze(1)
        return greedy

    def verify(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        proposals: list[list[int]],
        grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> list[tuple[list[int], int, Logprobs | None]]:
        """Speculative decoding's check of n-gram proposals: per request, `rows` and `logits`
        hold 1 + k positions (position j read after the first j proposals), processed as in
        `__call__`. Per request: (the accepted proposals, the token after them, logprobs of
        all of them or None).

        Greedy: proposals are accepted while they are the processed logits' argmax; the
        argmax after them is the token. Temperature > 0: at each position the token is drawn
        from p_j, the distribution plain sampling would draw from there, with one uniform
        from the request's generator as plain sampling does; the proposal is accepted when
        the draw is the proposal. With a one-hot draft (an n-gram proposes one token for sure)
        this is vLLM's rejection sampling exactly: x is accepted with probability p_j(x), and
        on rejection the token follows p_j without x, renormalised; after k acceptances the
        bonus token follows p_k. As the draws are plain sampling's own, a seeded request
        gives the tokens it gives without speculation (up to the float rounding of its logits
        in a step of more rows), repeats run to run whatever was proposed, and a preempted
        or resumed one continues its stream (`ModelRunner._generator`: one uniform per
        output token)."""
        logits = logits.float()
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(r.logprobs is not None for r in rows) else None
        )
        logits = self._apply_penalties(logits, rows)
        for i, row in enumerate(rows):
            _restrict(logits, i, row)
        if grammar is not None:  # one bitmask row per constrained position
            self._apply_grammar(logits, grammar)
        greedy: list[int] = argmax_rows(logits).tolist()
        random_rows = [i for i, r in enumerate(rows) if r.temperature > 0.0]
        probs = None
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = _probs(logits[idx], [rows[i] for i in random_rows])
        where = {row: j for j, row in enumerate(random_rows)}
        verdicts = []
        first = 0
        for proposal in proposals:
            k = len(proposal)
            row = rows[first]
            chosen: list[int] = []
            if row.temperature == 0.0:
                chosen = greedy_verdict(greedy, first, proposal)
            else:
                assert probs is not None
                generator = row.generator or self.generator
                for j in range(k + 1):
                    p = probs[where[first + j]]
                    cdf = p.cumsum(dim=-1)
                    u = torch.rand(1, generator=generator).to(cdf.device)
                    token = _draw(p, cdf, u * cdf[-1:], proposal[j] if j < k else None)
                    chosen.append(token)
                    if j == k or token != proposal[j]:
                        break
            lp = None
            if raw_logprobs is not None and row.logprobs is not None:
                per = [
                    _logprobs(raw_logprobs[first + j], t, row.logprobs)
                    for j, t in enumerate(chosen)
                ]
                lp = Logprobs(
                    [x for q in per for x in q.token_ids],
                    [x for q in per for x in q.logprobs],
                    [x for q in per for x in q.ranks],
                )
            verdicts.append((chosen[:-1], chosen[-1], lp))
            first += k + 1
        return verdicts


def _draw(
    probs: torch.Tensor, cdf: torch.Tensor, target: torch.Tensor, proposal: int | None
) -> int:
    """The token at one verified position: plain sampling's inverse transform of the draw
    (the proposal is accepted when this is it). A function so that a test can put a wrong
    acceptance rule in its place and show that its statistics catch it."""
    return _inverse_transform(probs, cdf, target)


def _probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution sampling draws from, per row (temperature > 0): temperature, top-k,
    top-p, min-p and the infill sampler applied to the processed logits."""
    device = logits.device
    x = logits / torch.tensor([r.temperature for r in rows], device=device)[:, None]
    # Only the rows that ask for top-k/top-p: the rounding of its cumulative mass drops a row's
    # least likely tokens even at top_p = 1.0, which must not depend on the other rows.
    cut = [j for j, r in enumerate(rows) if 0 < r.top_k < x.shape[1] or r.top_p < 1.0]
    if len(cut) == len(rows):
        x = _top_k_top_p(x, rows)
    elif cut:
        idx = torch.tensor(cut, device=device)
        x[idx] = _top_k_top_p(x[idx], [rows[j] for j in cut])
    probs = torch.softmax(x, dim=-1)
    if any(r.min_p > 0.0 for r in rows):
        min_p = torch.tensor([r.min_p for r in rows], device=device)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    for j, row in enumerate(rows):
        if row.infill is not None:
            probs[j] = infill_probs(probs[j], row.infill)
    return probs


def _inverse_transform(probs: torch.Tensor, cdf: torch.Tensor, target: torch.Tensor) -> int:
    """`Sampler._sample`'s draw on one row: the first token whose cumulative probability
    exceeds `target` ([1]), the most likely where float rounding took it past the last step."""
    token = int(torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[0] - 1))
    return token if float(probs[token]) > 0 else int(probs.argmax())


def _restrict(logits: torch.Tensor, i: int, row: SamplingRow) -> None:
    """logit_bias, allowed_token_ids, bad_words and min_tokens' bans on row i, in place."""
    if row.logit_bias is not None:
        ids, bias = row.logit_bias
        logits[i].index_add_(0, ids, bias)
    if row.allowed_token_ids is not None:
        keep = logits[i, row.allowed_token_ids]
        logits[i] = float("-inf")
        logits[i, row.allowed_token_ids] = keep
    if row.bad_words_token_ids:
        out = row.output_token_ids
        for word in row.bad_words_token_ids:
            # the word's last token is banned where the output ends with the rest of it
            prefix = word[:-1]
            if len(prefix) <= len(out) and (not prefix or out[len(out) - len(prefix) :] == prefix):
                logits[i, word[-1]] = float("-inf")
    if row.banned_token_ids:
        logits[i, row.banned_token_ids] = float("-inf")


def _apply_grammar(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Only the tokens the constraint allows (the C kernel `apply_token_bitmask_` does the same
    in place on the CPU, in a single pass, ~10x faster). Should the request's other bans (min_tokens, bad
    words, allowed_token_ids) leave none of them, the constraint alone decides: a token outside
    it would end the request with an error."""
    penalty = token_penalty(bitmask.to(logits.device), logits.shape[1])
    masked = logits[rows] + penalty
    empty = masked.amax(dim=-1) == float("-inf")
    if bool(empty.any()):
        masked[empty] = penalty[empty]
    logits[rows] = masked


def _top_k_top_p(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    sorted_x, order = x.sort(dim=-1, descending=True)
    vocab = x.shape[-1]
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=x.device)
    ranks = torch.arange(vocab, device=x.device)[None, :]
    drop = ranks >= top_k[:, None]
    top_p = torch.tensor([r.top_p for r in rows], device=x.device)[:, None]
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop |= before >= top_p
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def _logprobs(logprobs: torch.Tensor, token: int, num_top: int) -> Logprobs:
    chosen = logprobs[token]
    rank = int((logprobs > chosen).sum().item()) + 1
    ids = [token]
    values = [float(chosen)]
    if num_top:  # the engine core refuses more than the vocabulary; never index past it
        top = logprobs.topk(min(num_top, logprobs.shape[-1]))
        ids += top.indices.tolist()
        values += top.values.tolist()
    return Logprobs(token_ids=[ids], logprobs=[values], ranks=[rank])
