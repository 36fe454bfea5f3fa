"""Engine core <-> worker messages: one step's schedule (as a diff) and its sampled tokens.

Workers keep each running request's state between steps, so `SchedulerOutput` carries new
requests in full and running ones only as deltas. A preempted request is dropped by the
workers and comes back later as a new request with all its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treadle.sampling_params import SamplingParams
from treadle.wire.engine import Logprobs


@dataclass(slots=True)
class NewRequestData:
    request_id: str
    token_ids: list[int]  # prompt + output so far (outputs only after a preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    # A prompt given as embeddings ([num_prompt_tokens, hidden]): the model reads these rows
    # at the prompt's positions (its `token_ids` there are placeholders). Sent again in full
    # whenever the request is (after a preemption too).
    prompt_embeds: torch.Tensor | None = None


@dataclass(slots=True)
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Pipeline parallelism: the request's tokens sampled since the workers last heard of it
    # (only the last stage samples; the others learn them here, `core/pipeline.py`).
    new_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_request_ids: set[str] = field(default_factory=set)  # finished or preempted
    # Structured outputs: the constrained requests that sample in this step, and row i of
    # the int32 bitmask is the tokens request i may sample (`treadle.structured_outputs`).
    grammar_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None
    # Speculative decoding: per request, the proposed tokens that follow its last token in
    # this step (its scheduled tokens are 1 + their number; `core/spec_decode.py`).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class ModelRunnerOutput:
    # Per request that reached the end of its tokens this step: the sampled token.
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # Per request with `prompt_logprobs` whose prefill ran this step: (index in the prompt of
    # the first token scored, one row per scored prompt token).
    prompt_logprobs: dict[str, tuple[int, Logprobs]] = field(default_factory=dict)
    # Per speculating request: the proposed tokens it accepted, which come before `sampled`.
    accepted: dict[str, list[int]] = field(default_factory=dict)
    # Per pooling request whose prompt ended this step: its pooled hidden state (float32).
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
