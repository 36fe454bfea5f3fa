"""`SamplingParams`: how one request is sampled, with the rules of its own fields
(`check_sampling_params`, built from `treadle.checks`); validated on construction, sent on the
wire. `treadle.validation` stands above it and checks a request against the model."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import msgspec

from treadle.checks import (
    INT64_MAX,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP,
    MIN_TEMPERATURE,
    POOLING_TYPES,
    InvalidRequest,
    check_float,
    check_int,
    check_list,
    is_finite,
)
from treadle.config import ModelConfig, resolve_model


class StructuredOutputsParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A constraint on a request's output (vLLM's names): exactly one of `json` (a JSON
    schema, as a dict or its text), `regex`, `choice` (the output is one of these strings),
    `grammar` (Lark or GBNF), `json_object` (any JSON object) or `structural_tag` (its JSON
    text). Compiled by llguidance (`treadle.structured_outputs`); a grammar that does not
    compile is refused with the compiler's message."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        check_structured_outputs(self)
        if isinstance(self.json, dict) and not _msgpack_safe(self.json):
            # Its text from here on: msgpack cannot carry an int past 64 bits, JSON text can.
            self.json = json.dumps(self.json)

    @property
    def kind(self) -> str:
        """The one constraint given: "json", "regex", "choice", "grammar", ..."""
        return next(k for k in self.__struct_fields__ if getattr(self, k) not in (None, False))


def _msgpack_safe(value: Any) -> bool:
    """Whether msgpack can carry this JSON value: no int outside [-2**63, 2**64) (walked
    without recursion: a schema may nest deeper than Python's stack)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, int) and not -(2**63) <= item < 2**64:
            return False
    return True


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sampling settings of one request, with vLLM's names and defaults.

    Construction (and so decoding) checks every field with `check_sampling_params`
    and raises `InvalidRequest` (a `ValueError`) naming the bad one. `top_k` 0 (or vLLM's -1)
    means "no top-k"; a temperature in (0, 0.01) is raised to 0.01, as vLLM does.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Appended fields (the wire is array-like: new fields only ever go last).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # The token ids of `bad_words` (each word with and without a leading space), set by the
    # front end's `InputProcessor`, which has the tokenizer; the engine core bans by these.
    bad_words_token_ids: list[list[int]] | None = None
    # llama.cpp's `infill` sampler after top-k/top-p/min-p (its /infill's plug-ins ask for it):
    # end the middle when end-of-generation tokens (eos and `stop_token_ids`) are likely,
    # merge tokens whose text starts another's, keep only the likely ones (worker/sampler.py).
    infill: bool = False
    # A pooling request (`/v1/embeddings`, `LLM.embed`): its prompt is read and no token is
    # sampled; it ends with the last prompt position's final hidden state ("last") or the
    # mean over all positions ("mean"), unnormalised (`EngineCoreOutput.pooled`).
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if is_finite(self.temperature) and 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        check_sampling_params(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes: object) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def check_sampling_params(p: SamplingParams, where: str = "SamplingParams.") -> None:
    """The rules that need no model. Raises `InvalidRequest` naming the first bad field."""
    try:
        _check_sampling_params(p)
    except InvalidRequest as e:
        raise InvalidRequest(e.param, e.detail, where) from None


def _check_sampling_params(p: SamplingParams) -> None:
    check_int(p.n, "n", 1, MAX_N)
    check_float(p.temperature, "temperature", 0.0, math.inf)
    check_float(p.top_p, "top_p", 0.0, 1.0, low_open=True)
    check_int(p.top_k, "top_k", 0)  # 0 (or vLLM's -1, normalised to 0) means no top-k
    check_float(p.min_p, "min_p", 0.0, 1.0)
    check_float(p.presence_penalty, "presence_penalty", -2.0, 2.0)
    check_float(p.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    check_float(p.repetition_penalty, "repetition_penalty", 0.0, math.inf, low_open=True)
    if p.seed is not None:
        # Sample i of n draws with seed + i, which must stay an int64 too.
        check_int(p.seed, "seed", high=INT64_MAX - (p.n - 1))
    if p.max_tokens is not None:
        check_int(p.max_tokens, "max_tokens", 1)
    check_int(p.min_tokens, "min_tokens", 0)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise InvalidRequest(
            "min_tokens", f"must be <= max_tokens ({p.max_tokens}), got {p.min_tokens}"
        )
    if p.logprobs is not None:
        check_int(p.logprobs, "logprobs", 0)
    if p.pooling is not None:
        if p.pooling not in POOLING_TYPES:
            raise InvalidRequest("pooling", f"must be one of {', '.join(POOLING_TYPES)}")
        if p.n != 1 or p.logprobs is not None or p.prompt_logprobs is not None:
            raise InvalidRequest("pooling", "takes no n, logprobs or prompt_logprobs")
        if p.structured_outputs is not None:
            raise InvalidRequest("pooling", "takes no output constraint")
    check_list(p.stop, "stop")
    if not all(isinstance(s, str) and s for s in p.stop):
        raise InvalidRequest("stop", "must be non-empty strings")
    check_list(p.stop_token_ids, "stop_token_ids")
    for t in p.stop_token_ids:
        check_int(t, "stop_token_ids", 0)
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            raise InvalidRequest("logit_bias", "must map token ids to numbers")
        for t, bias in p.logit_bias.items():
            check_int(t, "logit_bias", 0)
            check_float(bias, "logit_bias", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    if p.allowed_token_ids is not None:
        check_list(p.allowed_token_ids, "allowed_token_ids", limit=None)
        if not p.allowed_token_ids:
            raise InvalidRequest("allowed_token_ids", "must not be empty")
        for t in p.allowed_token_ids:
            check_int(t, "allowed_token_ids", 0)
    if p.bad_words is not None:
        check_list(p.bad_words, "bad_words")
        if not all(isinstance(w, str) and w.strip() for w in p.bad_words):
            raise InvalidRequest("bad_words", "must be non-blank strings")
    if p.bad_words_token_ids is not None:
        check_list(p.bad_words_token_ids, "bad_words_token_ids", limit=2 * MAX_STOP)
        for word in p.bad_words_token_ids:
            check_list(word, "bad_words_token_ids")
            if not word:
                raise InvalidRequest("bad_words_token_ids", "must not hold an empty word")
            for t in word:
                check_int(t, "bad_words_token_ids", 0)
    if p.prompt_logprobs is not None:
        check_int(p.prompt_logprobs, "prompt_logprobs", 0)
    if p.truncate_prompt_tokens is not None:
        check_int(p.truncate_prompt_tokens, "truncate_prompt_tokens", 1)
    if p.structured_outputs is not None:
        if not isinstance(p.structured_outputs, StructuredOutputsParams):
            raise InvalidRequest("structured_outputs", "must be StructuredOutputsParams")
        check_structured_outputs(p.structured_outputs)


def check_structured_outputs(s: StructuredOutputsParams) -> None:
    """Exactly one constraint, of the right type and a sane size (that it compiles is
    `treadle.structured_outputs`' business)."""
    given = [k for k in s.__struct_fields__ if getattr(s, k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest(
            "structured_outputs",
            "must set exactly one of json, regex, choice, grammar, json_object, structural_tag"
            f" (got {', '.join(given) or 'none'})",
        )
    kind = given[0]
    value = getattr(s, kind)
    if kind == "json":
        if not isinstance(value, str | dict):
            raise InvalidRequest("structured_outputs.json", "must be a JSON schema")
        size = len(value) if isinstance(value, str) else len(repr(value))
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest("structured_outputs.choice", "must be a non-empty list of strings")
        size = sum(len(c) for c in value)
    elif kind == "json_object":
        if value is not True:
            raise InvalidRequest("structured_outputs.json_object", "must be true")
        size = 0
    else:
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"structured_outputs.{kind}", "must be a non-empty string")
        size = len(value)
    if size > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(
            f"structured_outputs.{kind}", f"is longer than {MAX_GRAMMAR_CHARS} characters"
        )


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams` (and transformers' `early_stopping`), for `LLM.beam_search`
    (`frontend/beam_search.py`)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BeamSearchParams.{name} must be an integer >= 1, not {value!r}")
        if self.temperature != 0:
            raise ValueError(
                f"BeamSearchParams.temperature={self.temperature!r} cannot be honoured: beam "
                "search ranks beams by the model's log-probabilities and samples nothing (give 0)"
            )
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp):
            raise ValueError(f"BeamSearchParams.length_penalty must be a number, not {lp!r}")
        stop = self.early_stopping
        if not (stop is True or stop is False or stop == "never"):
            raise ValueError(
                f'BeamSearchParams.early_stopping must be true, false or "never", not '
                f"{self.early_stopping!r}"
            )

    @property
    def num_logprobs(self) -> int:
        """The logprobs each step asks for (transformers' and vLLM's 2 x beam width)."""
        return 2 * self.beam_width


# generation_config.json keys that are default sampling parameters (vLLM reads the same ones).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model: ModelConfig) -> dict[str, Any]:
    """The default sampling parameters of requests that set none (`--generation-config`):
    from the model's generation_config.json with `auto` (none when it has no such file), from
    the directory given, or none with `vllm`; then `--override-generation-config` over them
    (as vLLM's, with any of the three; a null drops the file's value)."""
    data: dict[str, Any] = {}
    if model.generation_config != "vllm":
        if model.generation_config == "auto":
            directory = resolve_model(model.model).directory
        else:
            directory = os.path.expanduser(model.generation_config)
        path = os.path.join(directory, "generation_config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
    if model.override_generation_config:
        data.update(json.loads(model.override_generation_config))
    return {key: data[key] for key in GENERATION_CONFIG_KEYS if data.get(key) is not None}
