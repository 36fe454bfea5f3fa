"""What a sampler needs about each request, torch-free: the row of settings (`SamplingRow`)
and the infill sampler's inputs (`Infill`, `TokenPieces`). Both samplers take these:
`sampler.Sampler` (PyTorch) and `np_sampler.NumpySampler` (numpy)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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
