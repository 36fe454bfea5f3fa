"""Batched sampling: penalties, logit_bias, allowed_token_ids, bad_words, min_tokens, the
structured-output bitmask, temperature, top-k/top-p/min-p, seeds, logprobs.

Logprobs are those of the model's raw distribution (vLLM's default `raw_logprobs`), before
any of the changes above. All rows are processed as one tensor; per-request settings become per-row tensors. A request
with a `seed` draws its noise from its own generator, one draw per step, so its tokens do
not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treadle.model.cpu_kernels import Kernels
from treadle.structured_outputs import token_penalty
from treadle.wire.engine import Logprobs


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first of equal ones; of a NaN, the first
    NaN), as `logits.max(dim=-1).indices` gives. On the CPU NumPy's vectorized argmax: ~3 us
    a row of the default model's 49,152 logits against PyTorch's ~27 (one thread), a
    single stream's step being ~3.5 ms."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1))
    return logits.max(dim=-1).indices


@dataclass
class SamplingRow:
    """What the sampler needs about one request (one row of logits)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]  # eos/stop ids while min_tokens is not reached
    generator: torch.Generator | None
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (token ids, biases)
    allowed_token_ids: torch.Tensor | None = None
    bad_words_token_ids: list[list[int]] | None = None
    infill: Infill | None = None


INFILL_MAX_CANDIDATES = 256
"""The infill sampler compares the texts of every pair of candidates: it sees at most this many
(the most likely; llama.vscode and llama.vim keep 40 with top_k)."""


class TokenPieces:
    """Each token's text as bytes (special tokens: empty, llama.cpp's `token_to_piece` without
    `special`), from a tokenizer loaded on first use: only the infill sampler needs it."""

    def __init__(self, load_tokenizer: Callable[[], Any]) -> None:
        self._load = load_tokenizer
        self._tokenizer: Any = None
        self._pieces: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            if self._tokenizer is None:
                self._tokenizer = self._load()
            text = self._tokenizer.decode([token], skip_special_tokens=True)
            piece = self._pieces[token] = text.encode("utf-8", "surrogatepass")
        return piece


@dataclass(frozen=True)
class Infill:
    """What llama.cpp's `infill` sampler needs about one request."""

    end_ids: frozenset[int]
    """Its end-of-generation tokens (llama.cpp's `is_eog`): eos and the stop token ids."""
    eot: int
    """The token it ends with when no candidate is likely enough."""
    pieces: TokenPieces


def infill_probs(probs: torch.Tensor, infill: Infill) -> torch.Tensor:
    """llama.cpp's `infill` sampler on one row of probabilities (after top-k/top-p/min-p): if
    end-of-generation tokens are likely enough (3 * p_eog * n > p_text) only they remain;
    otherwise each token whose text starts another candidate's takes (or gives) that one's
    probability, tokens under 0.2 go, then those under 1 / (kept + 1); with none left, `eot`."""
    nonzero = (probs > 0).nonzero().squeeze(1)
    if nonzero.numel() > INFILL_MAX_CANDIDATES:
        nonzero = nonzero[probs[nonzero].topk(INFILL_MAX_CANDIDATES).indices]
    values = probs[nonzero]
    order = values.argsort(descending=True)
    ids: list[int] = nonzero[order].tolist()
    total = float(values.sum())
    p: list[float] = [v / total for v in values[order].tolist()]
    end = [t in infill.end_ids for t in ids]
    n = len(ids)
    p_end = sum(v for v, e in zip(p, end, strict=True) if e)
    p_text = sum(v for v, e in zip(p, end, strict=True) if not e)
    keep: list[int]
    if 3 * p_end * n > p_text:
        keep = [i for i in range(n) if end[i]]
    else:
        dead = [False] * n
        for i0 in range(n):
            for i1 in range(n):
                if dead[i0]:
                    break
                if i0 == i1 or dead[i1]:
                    continue
                a, b = infill.pieces(ids[i0]), infill.pieces(ids[i1])
                if a and b.startswith(a):  # token i0's text starts token i1's
                    dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
                    p[dst] += p[src]
                    p[src], dead[src] = 0.0, True
        keep = [i for i in range(n) if p[i] >= 0.2 or end[i]]
        kept_text = sum(1 for i in keep if not end[i])
        if kept_text == 0:
            out = torch.zeros_like(probs)
            out[infill.eot] = 1.0
            return out
        mass = sum(p[i] for i in keep)
        threshold = 1.0 / (kept_text + 1)
        keep = [i for i in keep if p[i] / mass >= threshold or end[i]]
    out = torch.zeros_like(probs)
    mass = sum(p[i] for i in keep)
    for i in keep:
        out[ids[i]] = p[i] / mass
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
                while len(chosen) < k and greedy[first + len(chosen)] == proposal[len(chosen)]:
                    chosen.append(proposal[len(chosen)])
                chosen.append(greedy[first + len(chosen)])
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
    if any(r.top_k > 0 or r.top_p < 1.0 for r in rows):
        x = _top_k_top_p(x, rows)
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
