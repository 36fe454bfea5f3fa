"""`InvalidRequest` and the checks of one value (an int64, a finite float, a bounded list)
that every rule on a request is built from; the lowest of the request rules:
`sampling_params` checks its own fields with them, `validation` checks a request against the
model with them. Imports nothing of treadle."""

from __future__ import annotations

import math
import re
from typing import Any

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
POOLING_TYPES = ("last", "mean")
"""How a pooling request's hidden states become one vector (vLLM's `--pooling-type` names)."""


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


def check_int(value: Any, param: str, low: int = INT64_MIN, high: int = INT64_MAX) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequest(param, f"must be an integer in [{_n(low)}, {_n(high)}], got {value!r}")


def check_float(value: Any, param: str, low: float, high: float, low_open: bool = False) -> None:
    ok = is_finite(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        if high == math.inf:
            span = f"> {low}" if low_open else f">= {low}"
        else:
            span = f"in ({low}, {high}]" if low_open else f"in [{low}, {high}]"
        raise InvalidRequest(param, f"must be a finite number {span}, got {value!r}")


def _n(bound: int) -> str:
    return {INT64_MIN: "-2**63", INT64_MAX: "2**63 - 1"}.get(bound, str(bound))


def check_list(value: Any, param: str, limit: int | None = MAX_STOP) -> None:
    if not isinstance(value, list):
        raise InvalidRequest(param, f"must be a list, got {type(value).__name__}")
    if limit is not None and len(value) > limit:
        raise InvalidRequest(param, f"may have at most {limit} entries, got {len(value)}")
