"""llama.cpp's own generation endpoints, with its field names and response shape (issue 26
item 1): `POST /completion` (a prompt: text, token ids, or both mixed) and `POST /infill`
(fill-in-the-middle for editor plug-ins: `input_prefix`, `input_suffix`, `input_extra`, laid
out as llama.cpp lays them out, `fim.py`).

Both answer `{"content", "tokens", "stop", "stop_type", "timings", ...}`, or stream it as
server-sent `data:` events (no `[DONE]`, as llama.cpp). What llama.cpp's fields mean here:

- `n_predict` (or `max_tokens`): tokens to generate; -1 until the context is full; 0 reads the
  prompt only (llama.vim warms the cache so).
- `n_indent`: stop at the first line indented less than this (the line is cut), as llama.cpp.
- `t_max_predict_ms`: once a new line has been generated, stop when generation has run this
  long. `t_max_prompt_ms` is accepted and has no effect, as in llama.cpp (its "TODO").
- `samplers`: which samplers run (`penalties`, `top_k`, `top_p`, `min_p`, `temperature`,
  `infill`); those left out are off (no `temperature`: sampling at 1.0, as llama.cpp). Their
  order is treadle's (vLLM's: penalties, temperature, top-k, top-p, min-p, then infill).
- `repeat_penalty` covers the whole context (vLLM's `repetition_penalty`), not only the last
  `repeat_last_n` tokens.
- `id_slot`: the slot to run in, or -1 (the default) for the one llama-server would pick
  (`llamacpp_slots.py`); every answer says which. `cache_prompt: false` (which treadle's
  shared prefix cache cannot honour per request) is refused.
- `response_fields`: the response holds only these fields (`"timings/prompt_n"` style paths
  become keys), as llama.cpp.
- `grammar` (GBNF) and `json_schema` constrain the output.
- `lora: [{"id", "scale"}]`: the adapter of this request (`--lora-modules`' by their place in
  `GET /lora-adapters`; scale 1 or 0, one adapter at most); `"model": "<adapter>"` too; else
  the one `POST /lora-adapters` applied (`frontend/loras.py`).

Fields llama.cpp has and treadle does not (mirostat, DRY, XTC, typical-p, top-n-sigma,
`n_probs`, `logit_bias`) are refused with a 400 unless they say "off"; other unknown
fields are ignored with a warning, as for the OpenAI endpoints.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from treadle.entrypoints.openai.errors import error_for, is_bug
from treadle.entrypoints.openai.fim import (
    FimBudget,
    Mixed,
    end_of_generation_ids,
    fim_prompt,
    find_fim_tokens,
)
from treadle.entrypoints.openai.fim import tokenize_mixed as mixed_ids
from treadle.entrypoints.openai.llamacpp_progress import SAMPLERS, CompletionJob
from treadle.entrypoints.openai.llamacpp_slots import Slots
from treadle.entrypoints.openai.serving_base import Outputs, ServingBase, _data
from treadle.logger import init_logger
from treadle.sampling_params import SamplingParams, StructuredOutputsParams
from treadle.validation import InvalidRequest, check_max_tokens

logger = init_logger(__name__)

# llama.cpp's samplers treadle does not have, accepted in `samplers` when their field is off.
_OFF_SAMPLERS = ("dry", "typ_p", "typical_p", "xtc", "top_n_sigma")
# llama.cpp fields treadle does not implement, with the value that means "off".
_OFF_FIELDS: dict[str, Any] = {
    "mirostat": 0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "typical_p": 1.0,
    "top_n_sigma": -1.0,
    "n_probs": 0,
    "logit_bias": [],
    "n_cmpl": 1,
}


class ExtraChunk(BaseModel):
    filename: str = "tmp"
    text: str = ""


class LlamaCompletionRequest(BaseModel):
    """The fields of llama.cpp's `/completion` and `/infill` that treadle implements."""

    model_config = ConfigDict(extra="allow")

    prompt: Mixed | None = None
    input_prefix: Mixed = ""
    input_suffix: Mixed = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    n_predict: int | None = None
    max_tokens: int | None = None
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    n_indent: int = 0
    t_max_prompt_ms: int = -1
    t_max_predict_ms: int = -1
    samplers: list[str] | None = None
    id_slot: int = -1
    cache_prompt: bool = True
    response_fields: list[str] = Field(default_factory=list)
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    model: str | None = None


class LlamaCompletionServing:
    def __init__(self, base: ServingBase, slots: Slots):
        """`slots`: the API server's slots, one of which each request runs in."""
        self.base = base
        self.slots = slots
        eos = base.engine.input_processor.eos_token_id
        self.end_ids = [t for t in end_of_generation_ids(base.tokenizer) if t != eos]
        """The tokens besides eos that end a generation, as in llama.cpp."""

    async def create(self, req: LlamaCompletionRequest, raw: Request, infill: bool) -> Response:
        base = self.base
        base.check_model(req.model)
        lora = base.loras.llamacpp_request(req.model, (req.model_extra or {}).get("lora"))
        started = time.monotonic()
        _check_fields(req)
        self.slots.check(req.id_slot, auto=True)
        n_predict = _n_predict(req)
        ids = await base.inputs.run(_size(req), self._prompt_ids, req, infill, n_predict)
        params = self._params(req, n_predict, len(ids))
        rid = f"{'infill' if infill else 'cmpl'}-{int(time.time() * 1e6):x}"
        prepare = base.engine.input_processor.prepare
        names = {"structured_outputs.grammar": "grammar", "structured_outputs.json": "json_schema"}
        try:
            prepared = await base.inputs.run(
                len(ids), partial(prepare, lora_request=lora), f"{rid}-0", None, ids, params
            )
        except InvalidRequest as e:
            raise e.renamed(names) from None
        rank = base.dp_rank(raw)
        slot = await self.slots.acquire(req.id_slot, ids, _slot_params(req, n_predict))
        job = CompletionJob(req, ids, n_predict == 0, base.shown_model(lora), started, slot=slot)
        try:
            outputs = base.run([prepared], rank)
            if req.stream:
                stream = _sse(job, outputs, rid, self.slots)
                return StreamingResponse(stream, media_type="text/event-stream")
            return await base.until_done(raw, job.body(outputs))
        except BaseException:
            self.slots.release(slot, job.tokens())
            raise
        finally:
            if not req.stream:
                self.slots.release(slot, job.tokens())

    def _prompt_ids(self, req: LlamaCompletionRequest, infill: bool, n_predict: int) -> list[int]:
        processor = self.base.engine.input_processor
        tokenizer = processor.tokenizer
        vocab = processor.vocab_size
        if not infill:
            if req.prompt is None or req.prompt == "" or req.prompt == []:
                raise InvalidRequest("prompt", "is required")
            if isinstance(req.prompt, str):
                return processor.encode(req.prompt)
            return _parsed_mixed(tokenizer, req.prompt, vocab, processor)
        fim = find_fim_tokens(tokenizer)
        for name in ("input_prefix", "input_suffix"):
            value = getattr(req, name)
            if isinstance(value, str):
                processor.check_chars(len(value), name)
        extra = [(c.filename, c.text) for c in req.input_extra]
        processor.check_chars(sum(len(f) + len(t) for f, t in extra), "input_extra")
        prompt = req.prompt or ""
        prompt_ids = (
            processor.encode(prompt, add_special_tokens=False)
            if isinstance(prompt, str)
            else _parsed_mixed(tokenizer, prompt, vocab, processor)
        )
        scheduler = self.base.engine.config.scheduler
        budget = FimBudget(scheduler.max_num_batched_tokens, processor.max_model_len, n_predict)
        return fim_prompt(
            tokenizer,
            fim,
            mixed_ids(tokenizer, req.input_prefix, vocab, "input_prefix"),
            mixed_ids(tokenizer, req.input_suffix, vocab, "input_suffix"),
            extra,
            prompt_ids,
            budget,
        )

    def _params(
        self, req: LlamaCompletionRequest, n_predict: int, prompt_len: int
    ) -> SamplingParams:
        limits = self.base.engine.input_processor.limits
        if n_predict == 0:
            max_tokens = 1  # the engine runs one token for a prompt alone; it is not shown
        elif n_predict < 0:
            max_tokens = max(limits.max_model_len - prompt_len, 1)
        else:
            max_tokens = n_predict
            check_max_tokens(max_tokens, prompt_len, limits)
        on = set(SAMPLERS if req.samplers is None else req.samplers)
        defaults = self.base.sampling_defaults

        def pick(value: Any, name: str, fallback: Any) -> Any:
            return defaults.get(name, fallback) if value is None else value

        penalties = "penalties" in on
        constraint = None
        if req.grammar is not None and req.json_schema is not None:
            raise InvalidRequest("grammar", "give grammar or json_schema, not both")
        if req.grammar is not None:
            constraint = StructuredOutputsParams(grammar=req.grammar)
        elif req.json_schema is not None:
            constraint = StructuredOutputsParams(json=req.json_schema)
        return SamplingParams(
            temperature=pick(req.temperature, "temperature", 1.0) if "temperature" in on else 1.0,
            top_k=max(pick(req.top_k, "top_k", 0), 0) if "top_k" in on else 0,
            top_p=pick(req.top_p, "top_p", 1.0) if "top_p" in on else 1.0,
            min_p=pick(req.min_p, "min_p", 0.0) if "min_p" in on else 0.0,
            seed=None if req.seed == -1 else req.seed,
            repetition_penalty=pick(req.repeat_penalty, "repetition_penalty", 1.0)
            if penalties
            else 1.0,
            presence_penalty=req.presence_penalty if penalties else 0.0,
            frequency_penalty=req.frequency_penalty if penalties else 0.0,
            max_tokens=max_tokens,
            stop=list(req.stop),
            stop_token_ids=[] if req.ignore_eos else list(self.end_ids),
            ignore_eos=req.ignore_eos,
            structured_outputs=constraint,
            infill="infill" in on and req.samplers is not None,
        )


def _slot_params(req: LlamaCompletionRequest, n_predict: int) -> dict[str, Any]:
    """The request's settings as `GET /slots` shows them (llama-server's `params`)."""
    return {
        "n_predict": n_predict,
        "seed": req.seed,
        "temperature": req.temperature,
        "top_k": req.top_k,
        "top_p": req.top_p,
        "min_p": req.min_p,
        "stop": req.stop,
        "stream": req.stream,
    }


def _check_fields(req: LlamaCompletionRequest) -> None:
    extra = dict(req.model_extra or {})
    for name, off in _OFF_FIELDS.items():
        if name in extra and extra.pop(name) not in (off, None):
            raise InvalidRequest(name, "is not supported by treadle (leave it out or off)")
    for name in ("repeat_last_n", "n_keep", "n_discard", "min_keep", "timings_per_token", "lora"):
        extra.pop(name, None)  # (documented above) accepted: their effect is treadle's rule
    if extra:
        logger.warning("Ignored fields of a llama.cpp-style request: %s", ", ".join(sorted(extra)))
    for name in req.samplers or ():
        if name not in SAMPLERS and name not in _OFF_SAMPLERS:
            raise InvalidRequest(
                "samplers", f"unknown sampler {name!r}; treadle has {', '.join(SAMPLERS)}"
            )
    if not req.cache_prompt:
        raise InvalidRequest(
            "cache_prompt",
            "false is not supported: treadle's prefix cache is shared by all requests "
            "(start the server with --no-enable-prefix-caching to turn it off)",
        )
    if req.n_indent < 0:
        raise InvalidRequest("n_indent", f"must be at least 0, got {req.n_indent}")
    if len(req.response_fields) > 64:
        raise InvalidRequest("response_fields", "has more than 64 entries")


def _n_predict(req: LlamaCompletionRequest) -> int:
    value = req.n_predict if req.n_predict is not None else req.max_tokens
    value = -1 if value is None else value
    if value < -1:
        raise InvalidRequest("n_predict", f"must be -1 (no limit), 0 or more, got {value}")
    return value


def _size(req: LlamaCompletionRequest) -> int:
    def chars(value: Any) -> int:
        return len(value) if isinstance(value, (str, list)) else 0

    return (
        chars(req.prompt)
        + chars(req.input_prefix)
        + chars(req.input_suffix)
        + sum(len(c.text) for c in req.input_extra)
    )


def _parsed_mixed(tokenizer: Any, prompt: Any, vocab: int, processor: Any) -> list[int]:
    """A prompt of ids and texts; its texts with special tokens parsed (llama.cpp's prompt)."""
    ids: list[int] = []
    for item in prompt:
        if isinstance(item, str):
            ids += processor.encode(item, add_special_tokens=False)
        else:
            ids += mixed_ids(tokenizer, [item], vocab, "prompt")
    return ids


async def _sse(job: CompletionJob, outputs: Outputs, rid: str, slots: Slots) -> AsyncIterator[str]:
    """The stream: a `data:` event per new text, then the final one (llama.cpp's shape); its
    slot is released when it ends."""
    try:
        async for _, out in outputs:
            over = job.take(out)
            chunk = job.partial()
            if chunk is not None:
                yield _data(chunk)
            if over:
                break
        yield _data(job.final(streamed=True))
    except Exception as e:
        if is_bug(e):
            logger.exception("Streaming request %s failed", rid)
        yield _data(error_for(e)[1])
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
        if job.slot is not None:
            slots.release(job.slot, job.tokens())
