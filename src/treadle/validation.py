"""The one set of rules for what a client may ask of the engine, used at every edge: the HTTP
server, the offline `LLM`, `SamplingParams` itself, and again the engine core (which must never
trust what reaches its socket).

Two levels:
- `check_sampling_params`: rules that need no model (ranges, int64, finite floats, list sizes);
  `SamplingParams` runs them on construction and so on decoding.
- `check_request`: everything against the model's `ModelLimits` (vocabulary, context length,
  `max_logprobs`), plus the request's other fields.

Every failure is an `InvalidRequest` (a `ValueError`) that names the field, so the HTTP server
answers 400 with OpenAI's `param` and the engine core answers that request alone with an error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.sampling_params import SamplingParams, StructuredOutputsParams

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_N = 128
"""Most samples per prompt (OpenAI's limit for `n`)."""
MAX_STOP = 1024
"""Most stop strings and most stop token ids per request (each is checked on every step)."""
MAX_PROMPTS = 2048
"""Most sequences one request may start: its prompts times `n`."""
DEFAULT_MAX_LOGPROBS = 20
"""vLLM's `--max-logprobs` default."""
MIN_TEMPERATURE = 0.01
"""A temperature in (0, MIN_TEMPERATURE) is raised to it, as vLLM does: smaller ones overflow."""
MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a `logit_bias` value (-100 bans a token, 100 all but forces it)."""
MAX_GRAMMAR_CHARS = 1 << 20
"""Longest structured-output constraint (schema, regex, grammar, choices together), in chars."""


class InvalidRequest(ValueError):
    """A request the engine will not run. `param` names the field (OpenAI's error `param`),
    `detail` says what is wrong; `where` only prefixes the message (`SamplingParams.`)."""

    def __init__(self, param: str | None, detail: str, where: str = "") -> None:
        self.param, self.detail = param, detail
        super().__init__(f"{where}{param} {detail}" if param else detail)

    @property
    def message(self) -> str:
        """The message without `where`, as an HTTP client sees it."""
        return f"{self.param} {self.detail}" if self.param else self.detail

    def renamed(self, names: dict[str, str]) -> InvalidRequest:
        """The same error under the client's name for the field (chat's `top_logprobs`)."""
        if self.param is None or self.param not in names:
            return self
        return InvalidRequest(names[self.param], self.detail)


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the served model and the engine's settings."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int = DEFAULT_MAX_LOGPROBS


_UNSIGNED = re.compile(r"[0-9]+")
_SIGNED = re.compile(r"-?[0-9]+")


def parse_int(text: str, param: str, low: int = INT64_MIN, high: int = INT64_MAX) -> int:
    """The integer that `text` writes in ASCII digits, with a leading `-` only where `low` is
    negative, and nothing else: the one way a header or a string field becomes an int.
    (`str.isdigit()` takes "²", which `int()` refuses; `int()` takes "٣", " 1", "+1" and
    "1_0".) Raises `InvalidRequest` naming `param`, out of [low, high] too; never another
    error."""
    span = f"in [{_n(low)}, {_n(high)}]"
    if not (_SIGNED if low < 0 else _UNSIGNED).fullmatch(text):
        raise InvalidRequest(param, f"must be an integer {span} in ASCII digits, got {text!r}")
    # int() of thousands of digits is slow, then refused: more digits than int64 has are out.
    value = int(text) if len(text) <= 20 else None
    if value is None or not low <= value <= high:
        raise InvalidRequest(param, f"must be an integer {span}, got {text[:40]!r}")
    return value


def is_int64(value: Any) -> bool:
    return isinstance(value, int) and INT64_MIN <= value <= INT64_MAX


def is_finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _int(value: Any, param: str, low: int = INT64_MIN, high: int = INT64_MAX) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequest(param, f"must be an integer in [{_n(low)}, {_n(high)}], got {value!r}")


def _float(value: Any, param: str, low: float, high: float, low_open: bool = False) -> None:
    ok = is_finite(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        if high == math.inf:
            span = f"> {low}" if low_open else f">= {low}"
        else:
            span = f"in ({low}, {high}]" if low_open else f"in [{low}, {high}]"
        raise InvalidRequest(param, f"must be a finite number {span}, got {value!r}")


def _n(bound: int) -> str:
    return {INT64_MIN: "-2**63", INT64_MAX: "2**63 - 1"}.get(bound, str(bound))


def check_sampling_params(p: SamplingParams, where: str = "SamplingParams.") -> None:
    """The rules that need no model. Raises `InvalidRequest` naming the first bad field."""
    try:
        _check_sampling_params(p)
    except InvalidRequest as e:
        raise InvalidRequest(e.param, e.detail, where) from None


def _check_sampling_params(p: SamplingParams) -> None:
    _int(p.n, "n", 1, MAX_N)
    _float(p.temperature, "temperature", 0.0, math.inf)
    _float(p.top_p, "top_p", 0.0, 1.0, low_open=True)
    _int(p.top_k, "top_k", 0)  # 0 (or vLLM's -1, normalised to 0) means no top-k
    _float(p.min_p, "min_p", 0.0, 1.0)
    _float(p.presence_penalty, "presence_penalty", -2.0, 2.0)
    _float(p.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _float(p.repetition_penalty, "repetition_penalty", 0.0, math.inf, low_open=True)
    if p.seed is not None:
        # Sample i of n draws with seed + i, which must stay an int64 too.
        _int(p.seed, "seed", high=INT64_MAX - (p.n - 1))
    if p.max_tokens is not None:
        _int(p.max_tokens, "max_tokens", 1)
    _int(p.min_tokens, "min_tokens", 0)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise InvalidRequest(
            "min_tokens", f"must be <= max_tokens ({p.max_tokens}), got {p.min_tokens}"
        )
    if p.logprobs is not None:
        _int(p.logprobs, "logprobs", 0)
    if p.pooling is not None:
        if p.pooling not in POOLING_TYPES:
            raise InvalidRequest("pooling", f"must be one of {', '.join(POOLING_TYPES)}")
        if p.n != 1 or p.logprobs is not None or p.prompt_logprobs is not None:
            raise InvalidRequest("pooling", "takes no n, logprobs or prompt_logprobs")
        if p.structured_outputs is not None:
            raise InvalidRequest("pooling", "takes no output constraint")
    _list(p.stop, "stop")
    if not all(isinstance(s, str) and s for s in p.stop):
        raise InvalidRequest("stop", "must be non-empty strings")
    _list(p.stop_token_ids, "stop_token_ids")
    for t in p.stop_token_ids:
        _int(t, "stop_token_ids", 0)
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            raise InvalidRequest("logit_bias", "must map token ids to numbers")
        for t, bias in p.logit_bias.items():
            _int(t, "logit_bias", 0)
            _float(bias, "logit_bias", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    if p.allowed_token_ids is not None:
        _list(p.allowed_token_ids, "allowed_token_ids", limit=None)
        if not p.allowed_token_ids:
            raise InvalidRequest("allowed_token_ids", "must not be empty")
        for t in p.allowed_token_ids:
            _int(t, "allowed_token_ids", 0)
    if p.bad_words is not None:
        _list(p.bad_words, "bad_words")
        if not all(isinstance(w, str) and w.strip() for w in p.bad_words):
            raise InvalidRequest("bad_words", "must be non-blank strings")
    if p.bad_words_token_ids is not None:
        _list(p.bad_words_token_ids, "bad_words_token_ids", limit=2 * MAX_STOP)
        for word in p.bad_words_token_ids:
            _list(word, "bad_words_token_ids")
            if not word:
                raise InvalidRequest("bad_words_token_ids", "must not hold an empty word")
            for t in word:
                _int(t, "bad_words_token_ids", 0)
    if p.prompt_logprobs is not None:
        _int(p.prompt_logprobs, "prompt_logprobs", 0)
    if p.truncate_prompt_tokens is not None:
        _int(p.truncate_prompt_tokens, "truncate_prompt_tokens", 1)
    if p.structured_outputs is not None:
        from treadle.sampling_params import StructuredOutputsParams

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


def _list(value: Any, param: str, limit: int | None = MAX_STOP) -> None:
    if not isinstance(value, list):
        raise InvalidRequest(param, f"must be a list, got {type(value).__name__}")
    if limit is not None and len(value) > limit:
        raise InvalidRequest(param, f"may have at most {limit} entries, got {len(value)}")


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Every id is an int in [0, vocab_size). (Fast on long lists: the loops run in C.)"""
    if not ids:
        return
    if set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return
    for t in ids:  # name the first bad one
        if type(t) is not int or not 0 <= t < vocab_size:
            raise InvalidRequest(param, f"must be token ids in [0, {vocab_size}), got {t!r}")


def check_prompt(prompt_token_ids: Sequence[int], limits: ModelLimits) -> None:
    """A prompt the model can take: not empty, shorter than max_model_len, ids in the vocab."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequest("prompt", "is empty: give at least one token")
    if n >= limits.max_model_len:
        raise InvalidRequest(
            "prompt",
            f"has {n} tokens, but this model's maximum context length is "
            f"{limits.max_model_len} tokens (with room for at least one output token): "
            "shorten the prompt",
        )
    check_token_ids(prompt_token_ids, limits.vocab_size, "prompt")


def check_batch(num_prompts: int, n: int = 1) -> None:
    """A request of several prompts (each sampled `n` times) starts at most MAX_PROMPTS
    sequences."""
    if num_prompts > MAX_PROMPTS:
        raise InvalidRequest("prompt", f"may hold at most {MAX_PROMPTS} prompts")
    if num_prompts * n > MAX_PROMPTS:
        raise InvalidRequest(
            "n", f"times the {num_prompts} prompts must be at most {MAX_PROMPTS}, got {n}"
        )


def check_max_tokens(max_tokens: int, prompt_len: int, limits: ModelLimits) -> None:
    """The HTTP API's rule (OpenAI's): prompt + max_tokens must fit the context."""
    if prompt_len + max_tokens > limits.max_model_len:
        raise InvalidRequest(
            "max_tokens",
            f"is too large: this model's maximum context length is {limits.max_model_len} "
            f"tokens, and you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
            f"prompt, {max_tokens} for the completion). Reduce the prompt or max_tokens.",
        )


def check_resumed(request: Any, limits: ModelLimits) -> None:
    """The outputs of a resumed `EngineCoreRequest` (`resumed_output_token_ids`): token ids
    that leave room for at least one more token, within max_tokens and the context."""
    outputs = request.resumed_output_token_ids
    param = "resumed_output_token_ids"
    _list(outputs, param, limit=None)
    check_token_ids(outputs, limits.vocab_size, param)
    if len(request.prompt_token_ids) + len(outputs) >= limits.max_model_len:
        raise InvalidRequest(param, "leave no room in the context for another token")
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None and len(outputs) >= max_tokens:
        raise InvalidRequest(param, f"are already max_tokens ({max_tokens}) tokens")
    _int(
        request.resumed_prompt_logprobs, "resumed_prompt_logprobs", 0, len(request.prompt_token_ids)
    )


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    limits: ModelLimits,
    eos_token_id: int | None = None,
    priority: int = 0,
) -> None:
    """Everything about one request against the model; raises `InvalidRequest`.

    Runs `check_sampling_params` again too: a `SamplingParams` may have been changed after it
    was built, and the engine core must not rely on its sender."""
    from treadle.sampling_params import SamplingParams

    if not isinstance(params, SamplingParams):
        raise InvalidRequest("sampling_params", "must be SamplingParams")
    check_sampling_params(params, where="")
    check_prompt(prompt_token_ids, limits)
    check_token_ids(params.stop_token_ids, limits.vocab_size, "stop_token_ids")
    if params.logit_bias:
        check_token_ids(list(params.logit_bias), limits.vocab_size, "logit_bias")
    if params.allowed_token_ids is not None:
        check_token_ids(params.allowed_token_ids, limits.vocab_size, "allowed_token_ids")
    for word in params.bad_words_token_ids or ():
        check_token_ids(word, limits.vocab_size, "bad_words")
    if eos_token_id is not None:
        check_token_ids([eos_token_id], limits.vocab_size, "eos_token_id")
    if params.logprobs is not None:
        most = min(limits.max_logprobs, limits.vocab_size)
        if params.logprobs > most:
            raise InvalidRequest(
                "logprobs",
                f"asks for {params.logprobs} logprobs per token, more than this server allows "
                f"({most}; see --max-logprobs)",
            )
    if params.prompt_logprobs is not None:
        most = min(limits.max_logprobs, limits.vocab_size)
        if params.prompt_logprobs > most:
            raise InvalidRequest(
                "prompt_logprobs",
                f"asks for {params.prompt_logprobs} logprobs per prompt token, more than this "
                f"server allows ({most}; see --max-logprobs)",
            )
    _int(priority, "priority")


POOLING_TYPES = ("last", "mean")
"""How a pooling request's hidden states become one vector (vLLM's `--pooling-type` names)."""

TENSOR_IPC_MODES = ("direct", "shm")
"""How request tensors reach the engine cores (`--tensor-ipc`, `ipc/tensor_ring.py`)."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


def check_filename(filename: object) -> str | None:
    """Why `filename` is no plain file name in the save directory (None when it is one): no
    path separators, no `..`, no leading dot, at most 201 characters of [A-Za-z0-9._-]."""
    if not isinstance(filename, str) or not _NAME.fullmatch(filename) or ".." in filename:
        return (
            "must be a plain file name (letters, digits, '.', '_', '-'; no path, no '..'), "
            f"got {filename!r:.80}"
        )
    return None
