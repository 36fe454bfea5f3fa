"""What `LLM.generate` returns, with vLLM's names: `RequestOutput` and `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
class RequestMetrics:
    """When one request reached its milestones (vLLM's `RequestMetrics` names). Times are
    wall-clock seconds (`time.time()`) taken in the front end as outputs arrive; `time_in_queue`
    and `prefill_time` are durations the engine core measured (waiting before it was first
    scheduled; from then to its first token)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    prefill_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def first_token_latency(self) -> float | None:
        """Seconds from arrival to the first token (TTFT)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


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
    metrics: RequestMetrics | None = None
    # A pooling request's result: the pooled final hidden state, float32 [hidden_size],
    # not normalised (`/v1/embeddings` and `LLM.embed` normalise it).
    pooled: Any = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (`LLM.embed`, vLLM's shape): `outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def unit_vector(pooled: Any) -> Any:
    """A pooled hidden state (a float32 tensor or numpy array) scaled to length 1, as a float32
    numpy array (a zero vector stays zero)."""
    import numpy as np

    vector = np.asarray(pooled, dtype=np.float32)
    norm = np.float32(np.sqrt(np.dot(vector, vector)))
    return vector / max(norm, np.float32(1e-12))
