"""What a sampler needs about each request, torch-free: the row of settings (`SamplingRow`)
and the infill sampler's inputs (`Infill`, `TokenPieces`). Both samplers take these:
`sampler.Sampler` (PyTorch) and `np_sampler.NumpySampler` (numpy); both runners make them
with the functions at the end (a request's rows, a verification's, the grammar's rows)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from treadle.sampling_params import SamplingParams
from treadle.wire.worker import SchedulerOutput


@dataclass
class SamplingRow:
    """What the sampler needs about one request (one row of logits). The array fields are the
    sampler's kind: torch tensors for `Sampler`, numpy arrays for `NumpySampler`."""

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
    generator: Any  # a seeded request's draws: torch.Generator / np_sampler.Draws; or None
    logit_bias: tuple[Any, Any] | None = None  # (token ids, biases)
    allowed_token_ids: Any = None
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


def infill_keep(ids: list[int], p: list[float], infill: Infill) -> dict[int, float]:
    """llama.cpp's `infill` sampler on candidates `ids` (the most likely first) of probabilities
    `p` (summing to 1; changed): the tokens it keeps and their probabilities. If
    end-of-generation tokens are likely enough (3 * p_eog * n > p_text) only they remain;
    otherwise each token whose text starts another candidate's takes (or gives) that one's
    probability, tokens under 0.2 go, then those under 1 / (kept + 1); with none left, `eot`."""
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
            return {infill.eot: 1.0}
        mass = sum(p[i] for i in keep)
        threshold = 1.0 / (kept_text + 1)
        keep = [i for i in keep if p[i] / mass >= threshold or end[i]]
    mass = sum(p[i] for i in keep)
    return {ids[i]: p[i] / mass for i in keep}


class RequestRows(Protocol):
    """What both runners' request states offer for their sampling rows."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    generator: Any
    logit_bias: Any
    allowed_token_ids: Any


def sampling_row(
    state: RequestRows, pieces: TokenPieces | None, prompt_ids: bool = True
) -> SamplingRow:
    """A request's row for its next token: its settings, its tokens so far (`prompt_ids`
    False: an embeddings prompt, whose ids are placeholders, has none to penalize), and the
    eos/stop ids banned while `min_tokens` is not reached."""
    p = state.sampling_params
    outputs = state.token_ids[state.num_prompt_tokens :]
    banned: list[int] = []
    if len(outputs) < p.min_tokens:
        banned = list(p.stop_token_ids)
        if state.eos_token_id is not None and not p.ignore_eos:
            banned.append(state.eos_token_id)
    return SamplingRow(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logprobs=p.logprobs,
        prompt_token_ids=state.token_ids[: state.num_prompt_tokens] if prompt_ids else [],
        output_token_ids=outputs,
        banned_token_ids=banned,
        generator=state.generator,
        logit_bias=state.logit_bias,
        allowed_token_ids=state.allowed_token_ids,
        bad_words_token_ids=p.bad_words_token_ids or [],
        infill=_infill(state, pieces) if p.infill else None,
    )


def _infill(state: RequestRows, pieces: TokenPieces | None) -> Infill:
    if pieces is None:
        raise RuntimeError("the infill sampler needs the tokenizer's token texts")
    p = state.sampling_params
    ends = frozenset(p.stop_token_ids) | (
        frozenset() if state.eos_token_id is None else {state.eos_token_id}
    )
    eot = state.eos_token_id if state.eos_token_id is not None else min(ends, default=0)
    return Infill(ends, eot, pieces)


def verify_rows(
    state: RequestRows, proposal: list[int], pieces: TokenPieces | None, prompt_ids: bool = True
) -> list[SamplingRow]:
    """A speculating request's rows, one per position: position j reads as if the first j
    proposals had been sampled (penalties and min_tokens see them)."""
    rows = []
    base = len(state.token_ids)
    for j in range(len(proposal) + 1):
        state.token_ids.extend(proposal[:j])
        rows.append(sampling_row(state, pieces, prompt_ids))
        del state.token_ids[base:]
    return rows


def grammar_rows(sched: SchedulerOutput, sampled_ids: list[str]) -> tuple[list[int], list[int]]:
    """(rows of the sampled logits, their bitmask rows) of the structured-output requests
    among `sampled_ids` (the engine core fills the bitmask once, for all ranks)."""
    if sched.grammar_bitmask is None:
        return [], []
    where = {rid: i for i, rid in enumerate(sampled_ids)}
    rows, mask_rows = [], []
    for j, rid in enumerate(sched.grammar_request_ids):
        if rid in where:
            rows.append(where[rid])
            mask_rows.append(j)
    return rows, mask_rows


def verify_grammar_rows(
    sched: SchedulerOutput, verifying: list[tuple[str, int]]
) -> tuple[list[int], list[int]]:
    """(rows of the verifying logits, their bitmask rows) of the speculating requests
    (`verifying`: each one's id and 1 + k positions, in the logits' order) under a grammar:
    such a request's id repeats in `grammar_request_ids`, once per position it verifies."""
    if sched.grammar_bitmask is None:
        return [], []
    mask_rows: dict[str, list[int]] = {}
    for j, rid in enumerate(sched.grammar_request_ids):
        mask_rows.setdefault(rid, []).append(j)
    rows: list[int] = []
    masks: list[int] = []
    first = 0
    for rid, n in verifying:
        own = mask_rows.get(rid)
        if own is not None:
            if len(own) != n:
                raise ValueError(
                    f"request {rid!r} verifies {n} positions but has {len(own)} grammar "
                    "bitmask rows"
                )
            rows.extend(range(first, first + n))
            masks.extend(own)
        first += n
    return rows, masks


def greedy_verdict(greedy: list[int], first: int, proposal: list[int]) -> list[int]:
    """A greedy request's tokens at verification: its proposals while each is the argmax
    (`greedy`, per row; its rows from `first`), then the argmax after them."""
    chosen: list[int] = []
    while len(chosen) < len(proposal) and greedy[first + len(chosen)] == proposal[len(chosen)]:
        chosen.append(proposal[len(chosen)])
    chosen.append(greedy[first + len(chosen)])
    return chosen
