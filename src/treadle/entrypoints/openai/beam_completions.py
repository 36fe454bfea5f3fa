"""`/v1/completions` with vLLM's `use_beam_search`: `n` beams per prompt (`beam_width`),
`length_penalty` and transformers' `early_stopping` (`frontend/beam_search.py`), each step one
engine request per beam; the answer is the `n` best sequences of each prompt, best first. A
field that beam search cannot honour is a 400 that names it."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from treadle.entrypoints.openai.protocol import CompletionRequest, now, random_id
from treadle.frontend.beam_search import (
    BeamSearch,
    BeamSearchSequence,
    eos_token_ids,
    step_logprobs,
)
from treadle.outputs import RequestOutput
from treadle.sampling_params import BeamSearchParams, SamplingParams
from treadle.validation import InvalidRequest, check_max_tokens

if TYPE_CHECKING:
    from treadle.entrypoints.openai.serving_base import ServingBase

BEAM_FIELDS = ("use_beam_search", "length_penalty", "early_stopping")
"""vLLM's fields (and transformers' `early_stopping`) that only beam search reads."""
HONOURED = {
    "model",
    "prompt",
    "n",  # the beam width
    "max_tokens",
    "ignore_eos",
    "temperature",  # 0 only: nothing is sampled
    "seed",  # nothing is random: every seed gives the same answer
    "user",
    "add_special_tokens",
    "skip_special_tokens",
    "return_token_ids",
    "stream",  # false only
}


def wants_beam_search(req: CompletionRequest) -> bool:
    return bool((req.model_extra or {}).get("use_beam_search"))


def beam_params(req: CompletionRequest, max_tokens: int) -> BeamSearchParams:
    """The request's `BeamSearchParams`; `InvalidRequest` naming a field that beam search
    cannot honour."""
    extra = dict(req.model_extra or {})
    given = req.model_fields_set - set(extra)  # (pydantic counts the extra fields in too)
    refused = sorted(set(extra) - set(BEAM_FIELDS)) + sorted(given - HONOURED)
    if refused:
        raise InvalidRequest(refused[0], "cannot be honoured with use_beam_search")
    if req.stream:
        raise InvalidRequest("stream", "cannot be honoured with use_beam_search (it answers once)")
    values: dict[str, Any] = {
        "temperature": req.temperature or 0.0,
        "length_penalty": extra.get("length_penalty", 1.0),
        "early_stopping": extra.get("early_stopping", False),
    }
    for name, value in values.items():
        try:
            BeamSearchParams(1, 1, **{name: value})
        except ValueError as e:
            raise InvalidRequest(name, str(e).split(": ", 1)[-1]) from None
    return BeamSearchParams(req.n, max_tokens, req.ignore_eos, **values)


async def beam_completion(base: ServingBase, req: CompletionRequest, raw: Request) -> Response:
    if base.check_model(req.model) is not None:
        raise InvalidRequest("model", "beam search runs on the base model, not on an adapter")
    if req.max_tokens == 0:
        raise InvalidRequest("max_tokens", "must be at least 1 with use_beam_search")
    prompts = await base.inputs.completion_prompts(req.prompt, False, None, req.add_special_tokens)
    limits = base.engine.input_processor.limits
    longest = max(len(ids) for _, ids in prompts)
    max_tokens = req.max_tokens or max(limits.max_model_len - longest, 1)
    check_max_tokens(max_tokens, longest, limits)
    params = beam_params(req, max_tokens)
    allowed = base.engine.config.model.max_logprobs
    if params.num_logprobs > allowed:
        raise InvalidRequest(
            "n",
            f"beam search of {req.n} beams asks {params.num_logprobs} logprobs a step; this "
            f"server allows {allowed} (--max-logprobs)",
        )
    eos = eos_token_ids(base.tokenizer)
    searches = [BeamSearch(ids, params, eos) for _, ids in prompts]
    work = _body(base, req, prompts, searches, params, base.dp_rank(raw))
    return await base.until_done(raw, work)


async def _search(
    base: ServingBase, searches: list[BeamSearch], params: BeamSearchParams, rank: int | None
) -> None:
    """Every step of every prompt's search, the prompts' beams in one batch a step."""
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=params.num_logprobs)
    prepare = base.engine.input_processor.prepare
    rid = random_id("beam")
    for n in itertools.count():
        batch = [(search, ids) for search in searches for ids in search.pending()]
        if not batch:
            return
        requests = [prepare(f"{rid}-{n}-{j}", None, ids, step) for j, (_, ids) in enumerate(batch)]
        final: dict[int, RequestOutput] = {}
        async for j, out in base.run(requests, rank):
            if out.finished:
                final[j] = out
        for search in searches:
            tops = [step_logprobs(final[j]) for j, (s, _) in enumerate(batch) if s is search]
            if tops:
                search.advance(tops)


async def _body(
    base: ServingBase,
    req: CompletionRequest,
    prompts: list[Any],
    searches: list[BeamSearch],
    params: BeamSearchParams,
    rank: int | None,
) -> dict[str, Any]:
    await _search(base, searches, params, rank)
    choices = []
    completion_tokens = 0
    for i, ((_, prompt_ids), search) in enumerate(zip(prompts, searches, strict=True)):
        for j, seq in enumerate(search.results()):
            ids = seq.tokens[len(prompt_ids) :]
            completion_tokens += len(ids)
            choices.append(_choice(base, req, i * req.n + j, prompt_ids, ids, seq))
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    return {
        "id": random_id("cmpl"),
        "object": "text_completion",
        "created": now(),
        "model": base.shown_model(None),
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _choice(
    base: ServingBase,
    req: CompletionRequest,
    index: int,
    prompt_ids: list[int],
    ids: list[int],
    seq: BeamSearchSequence,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": base.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens),
        "logprobs": None,
        "finish_reason": seq.finish_reason,
        "stop_reason": None,
        "prompt_logprobs": None,
        "prompt_token_ids": list(prompt_ids) if req.return_token_ids else None,
        "token_ids": list(ids) if req.return_token_ids else None,
    }
