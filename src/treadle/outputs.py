"""What `LLM.generate` returns, with vLLM's names: `RequestOutput` and `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log probability, its rank in the distribution (1 = most likely) and its
    text (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsDict = dict[int, Logprob]
"""Per position: {token id: Logprob}, the sampled (or prompt) token first, then the top-k by
rank (one entry fewer when the sampled token is among them)."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[LogprobsDict] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # With `prompt_logprobs`: per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[LogprobsDict | None] | None = None
