"""The one set of rules for what a client may ask of the engine, used at every edge: the HTTP
server, the offline `LLM`, `SamplingParams` itself, and again the engine core (which must never
trust what reaches its socket).

Three levels, each module over the one before (no cycle):
- `treadle.checks`: `InvalidRequest` and the checks of one value (ints, floats, lists).
- `treadle.sampling_params`: `check_sampling_params`, the rules that need no model (ranges,
  int64, finite floats, list sizes); `SamplingParams` runs them on construction and so on
  decoding.
- here, `check_request`: everything against the model's `ModelLimits` (vocabulary, context
  length, `max_logprobs`), plus the request's other fields.
This module re-exports the names of the two below, so callers import every rule from here.

Every failure is an `InvalidRequest` (a `ValueError`) that names the field, so the HTTP server
answers 400 with OpenAI's `param` and the engine core answers that request alone with an error.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treadle.checks import (
    DEFAULT_MAX_LOGPROBS,
    INT64_MAX,
    INT64_MIN,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP,
    MIN_TEMPERATURE,
    POOLING_TYPES,
    InvalidRequest,
    check_int,
    check_list,
    is_finite,
    is_int64,
    parse_int,
)
from treadle.sampling_params import (
    SamplingParams,
    StructuredOutputsParams,
    check_sampling_params,
    check_structured_outputs,
)

__all__ = [
    "DEFAULT_MAX_LOGPROBS",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_GRAMMAR_CHARS",
    "MAX_LOGIT_BIAS",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_STOP",
    "MIN_TEMPERATURE",
    "POOLING_TYPES",
    "TENSOR_IPC_MODES",
    "InvalidRequest",
    "ModelLimits",
    "StructuredOutputsParams",
    "check_batch",
    "check_filename",
    "check_max_tokens",
    "check_prompt",
    "check_request",
    "check_resumed",
    "check_sampling_params",
    "check_structured_outputs",
    "check_token_ids",
    "is_finite",
    "is_int64",
    "parse_int",
]


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the served model and the engine's settings."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int = DEFAULT_MAX_LOGPROBS


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
    check_list(outputs, param, limit=None)
    check_token_ids(outputs, limits.vocab_size, param)
    if len(request.prompt_token_ids) + len(outputs) >= limits.max_model_len:
        raise InvalidRequest(param, "leave no room in the context for another token")
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None and len(outputs) >= max_tokens:
        raise InvalidRequest(param, f"are already max_tokens ({max_tokens}) tokens")
    check_int(
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
    check_int(priority, "priority")


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
