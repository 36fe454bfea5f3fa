"""`SamplingParams`: how one request is sampled; validated on construction, sent on the wire."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sampling settings of one request, with vLLM's names and defaults.

    Construction validates every field and raises `ValueError` naming the bad one, so a bad
    request never reaches the engine. `top_k` 0 (or vLLM's -1) means "no top-k".
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        # One cheap test for the common case; the detailed checks only run to name a failure
        # (decoding a request runs this too, so it is on the engine's input path).
        ok = (
            self.n >= 1
            and self.temperature >= 0.0
            and 0.0 < self.top_p <= 1.0
            and self.top_k >= 0
            and 0.0 <= self.min_p <= 1.0
            and -2.0 <= self.presence_penalty <= 2.0
            and -2.0 <= self.frequency_penalty <= 2.0
            and self.repetition_penalty > 0.0
            and (self.max_tokens is None or self.max_tokens >= 1)
            and self.min_tokens >= 0
            and (self.max_tokens is None or self.min_tokens <= self.max_tokens)
            and (self.logprobs is None or self.logprobs >= 0)
            and all(self.stop)
        )
        if not ok:
            self._raise_invalid()

    def _raise_invalid(self) -> None:
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None:
            _check(self.logprobs >= 0, "logprobs", f"must be >= 0, got {self.logprobs}")
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes: object) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {message}")
