"""Beam search in the front end, as vLLM runs it: each step asks the engine for one token of
every running beam, with the top `K = 2 * beam_width` logprobs, and keeps the best; the
beams' shared prefix is read from the prefix cache, so a step costs about one decode step per
beam. The choice is transformers' `generate(num_beams=W, do_sample=False, length_penalty=...,
early_stopping=...)`, step for step:

- the K best continuations over all beams by summed logprob (float32 sums, as transformers');
- the W best of them that end neither with an EOS token nor at `max_tokens` run on;
- those of the first W that end are finished hypotheses scored `sum / generated ** length_penalty`
  (the EOS token counted in `generated`), the W best kept;
- the search ends when every candidate ends, when `early_stopping=True` and W hypotheses are
  finished, or (`early_stopping=False`, transformers' default) when the best running beam
  cannot beat the worst of W finished ones at its present length (`"never"` with a positive
  length penalty: at `max_tokens`).

vLLM differs in two details that this module does not copy: it divides by the length of the
prompt and the output without its EOS, and it keeps an EOS continuation of any of the K ranks;
it also always runs `max_tokens` steps (it has no `early_stopping`). See docs/api.md."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

from treadle.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's name): the prompt's and the generated token ids, the logprobs of each
    step (the top K of the token's position), the summed logprob, and once finished its
    score; `text` is filled by the caller."""

    tokens: list[int]
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    cum_logprob: float = 0.0
    score: float = -math.inf
    finish_reason: str | None = None  # "stop" (an EOS token) or "length"
    text: str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's: the best `beam_width` sequences, best first."""

    sequences: list[BeamSearchSequence]


def _f32(x: float) -> float:
    """`x` rounded to float32, as transformers' float32 tensors hold it (no numpy: the API
    server does not import it for this)."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def eos_token_ids(tokenizer: Any) -> set[int]:
    """The tokens that end a beam: the tokenizer's EOS (as vLLM's)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return set() if eos is None else {int(eos)}


def step_logprobs(out: Any) -> dict[int, Any]:
    """A step request's top logprobs (its one token's); `ValueError` with the engine's reason
    for a step the engine refused or ended without a token."""
    comp = out.outputs[0] if out.outputs else None
    if comp is None or not comp.logprobs:
        reason = comp.stop_reason if comp is not None else "no output"
        raise ValueError(f"a beam search step failed: {reason}")
    return dict(comp.logprobs[0])


class BeamSearch:
    """One prompt's search. `pending()` are the running beams whose next token the engine
    must score; `advance(tops)` takes, for each, its top logprobs ({token: logprob or an
    object with `.logprob`}); `done` says when to stop and `results()` what was found."""

    def __init__(
        self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: set[int]
    ) -> None:
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.keep = max(2, 1 + len(self.eos)) * params.beam_width  # transformers' K
        self.running = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.generated = 0
        self.improvable = True  # transformers' early-stop heuristic, not yet satisfied
        self.done = False

    def pending(self) -> list[list[int]]:
        return [] if self.done else [beam.tokens for beam in self.running]

    def advance(self, tops: list[dict[int, Any]]) -> None:
        width, lp = self.params.beam_width, self.params.length_penalty
        candidates = []
        for beam, top in zip(self.running, tops, strict=True):
            for token, entry in top.items():
                value = _f32(getattr(entry, "logprob", entry))
                candidates.append((_f32(beam.cum_logprob + value), beam, token, top))
        candidates.sort(key=lambda c: -c[0])
        candidates = candidates[: self.keep]
        length = self.generated + 1
        at_end = length >= self.params.max_tokens
        # transformers' rule: once W hypotheses are finished, early_stopping=True takes no more.
        closed = self.params.early_stopping is True and len(self.finished) == width
        running: list[BeamSearchSequence] = []
        for rank, (total, beam, token, top) in enumerate(candidates):
            ends = at_end or token in self.eos
            new = BeamSearchSequence([*beam.tokens, token], [*beam.logprobs, top], float(total))
            if not ends:
                if len(running) < width:
                    running.append(new)
                continue
            if rank >= width or not self.improvable or closed:
                continue
            new.score = _f32(total / _f32(length**lp))
            new.finish_reason = "stop" if token in self.eos else "length"
            self.finished.append(new)
        self.finished.sort(key=lambda b: -b.score)
        del self.finished[width:]
        self.running = running
        self.generated = length
        if len(self.finished) == width:
            best_len = (
                self.params.max_tokens
                if self.params.early_stopping == "never" and lp > 0
                else self.generated
            )
            best = (
                _f32(self.running[0].cum_logprob / _f32(best_len**lp))
                if (self.running)
                else _f32(-1e9)
            )
            self.improvable = self.improvable and best > self.finished[-1].score
        full_stop = self.params.early_stopping is True and len(self.finished) == width
        self.done = not self.improvable or full_stop or not running

    def results(self) -> list[BeamSearchSequence]:
        """The best `beam_width` finished hypotheses, best first."""
        return list(self.finished)
