"""The sampler on numpy float32 logits, torch never imported: `sampler.Sampler`'s contract,
order of changes and draws (penalties, logit_bias, allowed_token_ids, bad_words, min_tokens'
bans, the structured-output bitmask, temperature, top-k/top-p/min-p, the infill sampler,
seeds, raw logprobs), for a runner that has no torch.

The logits are processed in place, as `Sampler` does with float32 logits: pass a copy to keep
them (other dtypes are converted, so the caller's array is then untouched). Rows that no
setting changes cost nothing but the argmax, and only those asking for logprobs get a
log-softmax.

Seeds: `Draws` is `torch.Generator`'s stream of `torch.rand(1)` on the CPU, drawn from numpy's
MT19937 (the same uniforms), so a seeded request draws the same numbers under both samplers,
and the cumulative sums are PyTorch's (float64 sums rounded to float32). What can still differ
is the float rounding of the probabilities: PyTorch's softmax takes a faster exp than numpy's
(~1e-6 relative apart), which moves a draw across a step of the cumulative distribution only
where it lands within that much of it: measured on random rows of 49,152 logits, 2 tokens in
1,440 differ, each the neighbour of the other (0 in 1,440 at 8,192: `test_np_sampler.py`). Equal
logits at a top-k/top-p cut may also be cut differently. To give identical tokens always, both
samplers would call one C function for "probabilities, cumulative sum, draw".
"""

from __future__ import annotations

import ctypes

import numpy as np

from treadle.wire.engine import Logprobs
from treadle.worker.sampling_rows import (
    INFILL_MAX_CANDIDATES,
    Infill,
    SamplingRow,
    greedy_verdict,
    infill_keep,
)

CDF_BLOCK = 64  # `_first_past`'s block of probabilities

TOP_P_PREFIX = 1024
"""Top-p without top-k first looks among this many of the most likely tokens (a partition, not
a sort of the vocabulary) and sorts everything only where they do not reach `top_p`."""


class Draws:
    """A seeded request's uniforms, exactly `torch.rand(1, generator=g)` on the CPU for
    `g = torch.Generator().manual_seed(seed)` after `skip` such draws: MT19937 seeded with
    `init_genrand(seed mod 2**32)` (numpy's legacy seeding, which `RandomState(int)` runs),
    each draw the low 24 bits of one 32-bit output times 2**-24. A negative seed is taken as
    its two's complement, as PyTorch does; PyTorch refuses seeds of 2**64 and more, taken here
    mod 2**32 as well (`SamplingParams` allows int64 seeds only)."""

    _BLOCK = 64  # 32-bit outputs drawn at a time: the stream does not depend on it

    def __init__(self, seed: int, skip: int = 0) -> None:
        self._mt = np.random.RandomState(seed & 0xFFFFFFFF)
        self._next: list[int] = []
        for start in range(0, skip, 1 << 16):
            self._words(min(skip - start, 1 << 16))

    def _words(self, n: int) -> np.ndarray:
        return self._mt.randint(0, 1 << 32, size=n, dtype=np.uint32)

    def uniform(self) -> float:
        if not self._next:
            self._next = self._words(self._BLOCK)[::-1].tolist()
        return (self._next.pop() & 0xFFFFFF) * 2.0**-24


class NumpySampler:
    def __init__(self, seed: int, lib: ctypes.CDLL | None = None, threads: int = 1) -> None:
        self.draws = Draws(seed)  # unseeded rows' uniforms
        self.lib = lib  # the C kernels (`kernel_lib.open_library`) for the bitmask, or None
        self.threads = threads

    def __call__(
        self,
        logits: np.ndarray,
        rows: list[SamplingRow],
        grammar: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[list[int], list[Logprobs | None]]:
        """`Sampler.__call__` on float32 logits [rows, vocab]. `grammar`: (indices of rows
        under a structured-output constraint, their int32 token bitmask rows)."""
        logits, raw = self._process(logits, rows, grammar)
        tokens: list[int] = np.argmax(logits, axis=-1).tolist()
        for i, row in enumerate(rows):
            if row.temperature > 0.0:
                ids, probs = _probs(logits[i], row)
                tokens[i] = _inverse_transform(
                    ids, probs, self._draws(row).uniform(), logits.shape[1]
                )
        return tokens, [
            None if row.logprobs is None else _logprobs(raw[i], tokens[i], row.logprobs)
            for i, row in enumerate(rows)
        ]

    def verify(
        self,
        logits: np.ndarray,
        rows: list[SamplingRow],
        proposals: list[list[int]],
        grammar: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> list[tuple[list[int], int, Logprobs | None]]:
        """`Sampler.verify`: per request, 1 + k rows (position j read after the first j
        proposals); the proposals accepted while they are the token plain sampling gives
        there (greedy: the argmax; else one uniform from the request's draws per position),
        the token after them, and the logprobs of all of them or None."""
        logits, raw = self._process(logits, rows, grammar)
        greedy: list[int] = np.argmax(logits, axis=-1).tolist()
        verdicts = []
        first = 0
        for proposal in proposals:
            k = len(proposal)
            row = rows[first]
            chosen: list[int] = []
            if row.temperature == 0.0:
                chosen = greedy_verdict(greedy, first, proposal)
            else:
                draws = self._draws(row)
                for j in range(k + 1):
                    ids, probs = _probs(logits[first + j], rows[first + j])
                    token = _inverse_transform(ids, probs, draws.uniform(), logits.shape[1])
                    chosen.append(token)
                    if j == k or token != proposal[j]:
                        break
            lp = None
            if row.logprobs is not None:
                per = [_logprobs(raw[first + j], t, row.logprobs) for j, t in enumerate(chosen)]
                lp = Logprobs(
                    [x for q in per for x in q.token_ids],
                    [x for q in per for x in q.logprobs],
                    [x for q in per for x in q.ranks],
                )
            verdicts.append((chosen[:-1], chosen[-1], lp))
            first += k + 1
        return verdicts

    def _draws(self, row: SamplingRow) -> Draws:
        return row.generator if row.generator is not None else self.draws

    def _process(
        self,
        logits: np.ndarray,
        rows: list[SamplingRow],
        grammar: tuple[np.ndarray, np.ndarray] | None,
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """The logits as float32 with each row's penalties and restrictions and the grammar
        applied (in place), and the raw log-softmax of each row that asks for logprobs."""
        logits = np.asarray(logits, dtype=np.float32)
        raw = {i: log_softmax(logits[i]) for i, r in enumerate(rows) if r.logprobs is not None}
        for i, row in enumerate(rows):
            if _changes_logits(row):
                _penalize(logits[i], row)
                _restrict(logits[i], row)
        if grammar is not None:
            row_ids = np.ascontiguousarray(grammar[0], dtype=np.int64)
            bitmask = np.ascontiguousarray(grammar[1], dtype=np.int32)
            if self.lib is not None and logits.strides[1] == 4 and logits.flags.writeable:
                self.lib.apply_token_bitmask_f32(
                    logits.ctypes.data, logits.strides[0] // 4, row_ids.ctypes.data,
                    len(row_ids), bitmask.ctypes.data, bitmask.shape[1], logits.shape[1],
                    self.threads,
                )  # fmt: skip
            else:
                apply_grammar(logits, row_ids, bitmask)
        return logits, raw


def _changes_logits(row: SamplingRow) -> bool:
    return bool(
        row.repetition_penalty != 1.0
        or ((row.presence_penalty or row.frequency_penalty) and row.output_token_ids)
        or row.logit_bias is not None
        or row.allowed_token_ids is not None
        or row.bad_words_token_ids
        or row.banned_token_ids
    )


def _penalize(x: np.ndarray, row: SamplingRow) -> None:
    """Repetition, presence and frequency penalties on one row, in place (`Sampler`'s
    float32 arithmetic, on the tokens they touch only)."""
    if row.repetition_penalty != 1.0:
        seen = np.unique(np.array(row.prompt_token_ids + row.output_token_ids, dtype=np.int64))
        values = x[seen]
        penalty = np.float32(row.repetition_penalty)
        x[seen] = np.where(values > 0, values / penalty, values * penalty)
    if (row.presence_penalty or row.frequency_penalty) and row.output_token_ids:
        ids, counts = np.unique(np.array(row.output_token_ids, dtype=np.int64), return_counts=True)
        x[ids] -= np.float32(row.frequency_penalty) * counts.astype(np.float32) + np.float32(
            row.presence_penalty
        )


def _restrict(x: np.ndarray, row: SamplingRow) -> None:
    """logit_bias, allowed_token_ids, bad_words and min_tokens' bans on one row, in place."""
    if row.logit_bias is not None:
        ids, bias = row.logit_bias
        np.add.at(x, np.asarray(ids, dtype=np.int64), np.asarray(bias, dtype=np.float32))
    if row.allowed_token_ids is not None:
        allowed = np.asarray(row.allowed_token_ids, dtype=np.int64)
        keep = x[allowed]
        x[:] = -np.inf
        x[allowed] = keep
    if row.bad_words_token_ids:
        out = row.output_token_ids
        for word in row.bad_words_token_ids:
            # the word's last token is banned where the output ends with the rest of it
            prefix = word[:-1]
            if len(prefix) <= len(out) and (not prefix or out[len(out) - len(prefix) :] == prefix):
                x[word[-1]] = -np.inf
    if row.banned_token_ids:
        x[row.banned_token_ids] = -np.inf


def apply_grammar(logits: np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> None:
    """Only the tokens int32 bitmask row i allows in logits row rows[i], in place (the C
    kernel `apply_token_bitmask_f32` does the same; tokens past the mask's width are not
    allowed). Should the request's other bans leave none of them, the constraint alone
    decides: a token outside it would end the request with an error."""
    vocab = logits.shape[1]
    # bit k of word w is token 32 w + k: the int32 words' bytes in little-endian order
    bits = np.unpackbits(bitmask.astype("<i4").view(np.uint8), axis=1, bitorder="little")
    allowed = np.zeros((len(rows), vocab), dtype=bool)
    width = min(vocab, bits.shape[1])
    allowed[:, :width] = bits[:, :width]
    masked = np.where(allowed, logits[rows], np.float32(-np.inf))
    empty = masked.max(axis=-1) == -np.inf
    if empty.any():
        masked[empty] = np.where(allowed[empty], np.float32(0.0), np.float32(-np.inf))
    logits[rows] = masked


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float32 log-softmax over the last axis (one row, or each row of a batch)."""
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _probs(x: np.ndarray, row: SamplingRow) -> tuple[np.ndarray | None, np.ndarray]:
    """The distribution plain sampling draws from on one processed row (temperature > 0):
    the tokens it may draw (ascending; None: the whole vocabulary) and their probabilities,
    after temperature, top-k, top-p, min-p and the infill sampler (`sampler._probs`)."""
    t = np.float32(row.temperature)
    ids = None
    if 0 < row.top_k < x.shape[0] or row.top_p < 1.0:
        ids, x = _top_k_top_p(x, t, row.top_k, np.float32(row.top_p))
    else:
        x = x / t
    probs = _softmax(x)
    if row.min_p > 0.0:
        probs[probs < np.float32(row.min_p) * probs.max()] = 0.0
    if row.infill is not None:
        ids, probs = infill_probs(ids, probs, row.infill)
    return ids, probs


def _top_k_top_p(
    x: np.ndarray, t: np.float32, top_k: int, top_p: np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """The tokens top-k and top-p keep (ascending) and their logits / t: the k most likely,
    then those with less than top_p of the mass before them (`sampler._top_k_top_p`)."""
    vocab = x.shape[0]
    if 0 < top_k < vocab:
        ids = np.argpartition(x, vocab - top_k)[vocab - top_k :]
        xt = x[ids] / t
        order = np.argsort(-xt, kind="stable")
        ids, xt = ids[order], xt[order]
        probs = _softmax(xt)
        before = _cumsum(probs) - probs
    else:  # top-p alone: the softmax of the whole row, its head sorted
        everything = x / t
        e = np.exp(everything - everything.max())
        total = e.sum()
        ids = np.arange(vocab)
        if vocab > TOP_P_PREFIX:
            ids = np.argpartition(everything, vocab - TOP_P_PREFIX)[vocab - TOP_P_PREFIX :]
        while True:
            ids = ids[np.argsort(-everything[ids])]
            probs = e[ids] / total
            before = _cumsum(probs) - probs
            if len(ids) == vocab or before[-1] >= top_p:  # the rest goes too
                break
            ids = np.arange(vocab)
        xt = everything[ids]
    keep = before < top_p
    ids, xt = ids[keep], xt[keep]
    ascending = np.argsort(ids)
    return ids[ascending], xt[ascending]


def _cumsum(probs: np.ndarray) -> np.ndarray:
    """PyTorch's cumulative sum of float32 on the CPU: summed in float64, each rounded."""
    return np.cumsum(probs, dtype=np.float64).astype(np.float32)


def _inverse_transform(ids: np.ndarray | None, probs: np.ndarray, u: float, vocab: int) -> int:
    """The first token whose cumulative probability exceeds u times the total, as
    `Sampler._sample` draws; past the last step (float rounding), the vocabulary's last token
    where it is likely at all, as `Sampler` clamps, else the most likely."""
    j = _first_past(probs, np.float32(u))
    if j == len(probs):
        j -= 1
        if ids is not None and ids[j] != vocab - 1:
            return int(ids[np.argmax(probs)])
    if probs[j] <= 0:
        j = int(np.argmax(probs))
    return j if ids is None else int(ids[j])


def _first_past(probs: np.ndarray, u: np.float32) -> int:
    """The first index whose cumulative probability (`_cumsum`'s) exceeds u times the total;
    len(probs) where none does. A long row sums blocks of `CDF_BLOCK` first, then runs through
    the one block the draw lands in (a float64 sum in another order than one pass: the
    float32 sums differ only where one lands within ~1e-16 of a rounding midpoint), ~10x
    faster than numpy's cumulative sum of the whole row."""
    n = len(probs)
    if n <= 16 * CDF_BLOCK:
        cdf = _cumsum(probs)
        return int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    padded = np.zeros(-(-n // CDF_BLOCK) * CDF_BLOCK)
    padded[:n] = probs
    ends = np.cumsum(padded.reshape(-1, CDF_BLOCK).sum(axis=1))
    target = u * np.float32(ends[-1])
    b = int(np.searchsorted(ends.astype(np.float32), target, side="right"))
    if b == len(ends):
        return n
    block = padded[b * CDF_BLOCK : (b + 1) * CDF_BLOCK]
    block[0] += ends[b - 1] if b else 0.0
    within = np.searchsorted(np.cumsum(block).astype(np.float32), target, side="right")
    return min(b * CDF_BLOCK + int(within), n)


def infill_probs(
    ids: np.ndarray | None, probs: np.ndarray, infill: Infill
) -> tuple[np.ndarray, np.ndarray]:
    """`sampler.infill_probs` on one row in `_probs`' form (tokens, or None for all, and their
    probabilities): the tokens llama.cpp's infill sampler keeps, ascending, and theirs."""
    nonzero = np.flatnonzero(probs > 0)
    if len(nonzero) > INFILL_MAX_CANDIDATES:
        top = np.argpartition(probs[nonzero], len(nonzero) - INFILL_MAX_CANDIDATES)
        nonzero = nonzero[top[len(nonzero) - INFILL_MAX_CANDIDATES :]]
    values = probs[nonzero]
    order = np.argsort(-values, kind="stable")
    tokens = nonzero[order] if ids is None else ids[nonzero[order]]
    total = float(values.sum())
    kept = infill_keep(tokens.tolist(), [v / total for v in values[order].tolist()], infill)
    out = sorted(kept.items())
    return np.array([t for t, _ in out], dtype=np.int64), np.array(
        [p for _, p in out], dtype=np.float32
    )


def _logprobs(logprobs: np.ndarray, token: int, num_top: int) -> Logprobs:
    chosen = logprobs[token]
    rank = int(np.count_nonzero(logprobs > chosen)) + 1
    ids = [token]
    values = [float(chosen)]
    if num_top:  # the engine core refuses more than the vocabulary; never index past it
        n = min(num_top, logprobs.shape[0])
        top = np.argpartition(logprobs, logprobs.shape[0] - n)[logprobs.shape[0] - n :]
        top = top[np.lexsort((top, -logprobs[top]))]  # the likeliest first, then by id
        ids += top.tolist()
        values += logprobs[top].tolist()
    return Logprobs(token_ids=[ids], logprobs=[values], ranks=[rank])
