"""An HTTP request's fields -> `SamplingParams`: OpenAI's and vLLM's names (`logit_bias` with
string keys, `response_format`, `structured_outputs` and vLLM's older `guided_*`), fields that
are refused because ignoring them would change what the answer means, and the warning that
names the fields ignored."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from treadle.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIModel,
)
from treadle.logger import init_logger
from treadle.sampling_params import SamplingParams, StructuredOutputsParams
from treadle.validation import InvalidRequest, parse_int

logger = init_logger(__name__)

AnyRequest = CompletionRequest | ChatCompletionRequest

# Fields of OpenAI's or vLLM's API that treadle does not implement, with the values that mean
# "not used" (accepted, as a client library may send them) and what to say otherwise.
_Refusal = tuple[Callable[[Any, AnyRequest], bool], str]
_NOT_GIVEN: Callable[[Any, AnyRequest], bool] = lambda v, _: v is None  # noqa: E731
_FALSE: Callable[[Any, AnyRequest], bool] = lambda v, _: v is None or v is False  # noqa: E731
_EMPTY: Callable[[Any, AnyRequest], bool] = lambda v, _: v is None or v == [] or v == ""  # noqa: E731
_REFUSED_BOTH: dict[str, _Refusal] = {
    "use_beam_search": (_FALSE, "beam search is served on /v1/completions (and LLM.beam_search)"),
    "logits_processors": (_EMPTY, "custom logits processors are not supported"),
    "logprob_token_ids": (_EMPTY, "is not supported; use logprobs"),
}
_REFUSED: dict[type, dict[str, _Refusal]] = {
    CompletionRequest: {
        **_REFUSED_BOTH,
        "best_of": (
            lambda v, req: v is None or v == 1 or v == req.n,
            "is not supported (removed in vLLM v1): use n and pick a choice yourself",
        ),
    },
    ChatCompletionRequest: {
        **_REFUSED_BOTH,
        "functions": (_EMPTY, "is OpenAI's deprecated function-calling API: use tools"),
        "function_call": (_NOT_GIVEN, "is OpenAI's deprecated function-calling API: use tools"),
        "audio": (_NOT_GIVEN, "audio output is not supported: this model writes text only"),
        "modalities": (
            lambda v, _: v is None or v == ["text"],
            'only ["text"] is supported: this model writes text only',
        ),
        "prediction": (_NOT_GIVEN, "predicted outputs are not supported"),
        "web_search_options": (_NOT_GIVEN, "web search is not supported"),
        "echo": (_FALSE, "is not supported on chat completions"),
        "continue_final_message": (_FALSE, "is not supported yet"),
        "documents": (_EMPTY, "is not supported yet"),
        "prompt_embeds": (_EMPTY, "is taken by /v1/completions only (as vLLM's)"),
    },
}
_DEPRECATED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_warned_deprecated: set[str] = set()


def check_fields(req: AnyRequest) -> None:
    """Refuse (400) fields treadle does not implement where ignoring them would change the
    answer's meaning; log once per request, at WARNING, the names of the fields ignored."""
    extra = dict(req.model_extra or {})
    for name, (accepted, why) in _REFUSED[type(req)].items():
        if name in extra and not accepted(extra.pop(name), req):
            raise InvalidRequest(name, why)
    ignored = sorted(extra)
    for name, value in _nested(req):
        if isinstance(value, OpenAIModel) and value.model_extra:
            ignored += [f"{name}.{key}" for key in sorted(value.model_extra)]
    if ignored:
        logger.warning(
            "The following fields were present in the request but ignored: %s", set(ignored)
        )


def _nested(req: AnyRequest) -> list[tuple[str, Any]]:
    return [("stream_options", req.stream_options), ("structured_outputs", req.structured_outputs)]


def structured_outputs(req: AnyRequest) -> StructuredOutputsParams | None:
    """The one output constraint of a request, from `structured_outputs`, `response_format` or
    vLLM's older `guided_*` fields; two at once is a 400."""
    given: list[tuple[str, str, dict[str, Any]]] = []  # (param, what, constraint)
    if req.structured_outputs is not None:
        so = req.structured_outputs
        fields = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": so.json_object,
            "structural_tag": so.structural_tag,
        }
        kinds = {kind: value for kind, value in fields.items() if value not in (None, False)}
        if not kinds:
            StructuredOutputsParams()  # raises, saying what to give
        for kind, value in kinds.items():
            given.append(("structured_outputs", f"structured_outputs.{kind}", {kind: value}))
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        what = f"response_format {fmt.type}"
        given.append(("response_format", what, _from_response_format(req)))
    for name, kind in _DEPRECATED.items():
        value = getattr(req, name)
        if value is None:
            continue
        if name not in _warned_deprecated:
            _warned_deprecated.add(name)
            logger.warning(
                "%s is deprecated (as in vLLM): use structured_outputs.%s instead", name, kind
            )
        given.append((name, name, {kind: value}))
    if req.grammar is not None:  # llama.cpp's field (GBNF), not deprecated
        given.append(("grammar", "grammar", {"grammar": req.grammar}))
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(
            given[0][0],
            "asks for one output constraint at most, got "
            + " and ".join(what for _, what, _ in given),
        )
    return StructuredOutputsParams(**given[0][2])


def _from_response_format(req: AnyRequest) -> dict[str, Any]:
    fmt = req.response_format
    assert fmt is not None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidRequest(
                "response_format",
                'of type json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
            )
        return {"json": fmt.json_schema.json_schema}
    return {"structural_tag": json.dumps(fmt.model_dump(exclude_none=True))}


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as JSON object keys, so strings) with int keys."""
    if bias is None:
        return None
    return {parse_int(key, "logit_bias", 0): value for key, value in bias.items()}


def sampling_params(
    req: AnyRequest,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    truncate_prompt_tokens: int | None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """The request's `SamplingParams` (raises `InvalidRequest` naming a bad field).
    `defaults`: values of the fields the request leaves out (`generation_defaults`)."""
    given = req.model_fields_set
    fallback = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, **(defaults or {})}

    def pick(name: str) -> Any:
        value = getattr(req, name)
        if (name not in given or value is None) and name in fallback:
            return fallback[name]
        return value

    return SamplingParams(
        n=req.n,
        temperature=pick("temperature"),
        top_p=pick("top_p"),
        top_k=pick("top_k") or 0,
        min_p=pick("min_p"),
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=pick("repetition_penalty"),
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias=logit_bias(req.logit_bias),
        allowed_token_ids=None if req.allowed_token_ids is None else list(req.allowed_token_ids),
        bad_words=None if not req.bad_words else list(req.bad_words),
        prompt_logprobs=prompt_logprobs,
        truncate_prompt_tokens=truncate_prompt_tokens,
        structured_outputs=structured_outputs(req),
    )
