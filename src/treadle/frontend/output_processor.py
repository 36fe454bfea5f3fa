"""Outputs out: engine-core token deltas -> text, stop strings, logprobs, `RequestOutput`s.

A request with `n > 1` runs in the engine core as n child requests (`"{i}_{id}"`); their
outputs are merged back here into one `RequestOutput`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from treadle.frontend.detokenizer import IncrementalDetokenizer
from treadle.outputs import (
    CompletionOutput,
    Logprob,
    LogprobsDict,
    RequestMetrics,
    RequestOutput,
)
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import EngineCoreOutput, FinishReason, Logprobs


@dataclass
class _ChildState:
    index: int
    detok: IncrementalDetokenizer
    completion: CompletionOutput


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, _ChildState] = field(default_factory=dict)
    num_cached_tokens: int = 0
    prompt_logprobs: list[LogprobsDict | None] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))
    pooled: Any = None  # a pooling request's result (a float32 tensor)

    @property
    def finished(self) -> bool:
        return all(c.completion.finished for c in self.children.values())


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of n samples gets its own seed (seed + index), so they differ yet reproduce; only
    the first scores the prompt (`prompt_logprobs`), which is the same for all."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return params.clone(n=1, seed=seed, prompt_logprobs=prompt_logprobs)


class TokenTexts:
    """The text of single tokens (for logprobs), decoded once per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = str(self.tokenizer.decode([token_id]))
        return text

    def entries(self, lp: Logprobs) -> list[LogprobsDict]:
        """Each row of `lp` as {token id: Logprob}: entry 0 with its rank, then the top-n."""
        rows = []
        for ids, values, rank in zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True):
            row = {ids[0]: Logprob(values[0], rank, self(ids[0]))}
            for r, (t, v) in enumerate(zip(ids[1:], values[1:], strict=True), start=1):
                if t not in row:
                    row[t] = Logprob(v, r, self(t))
            rows.append(row)
        return rows


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self._parents: dict[str, _ParentState] = {}
        self._child_to_parent: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> list[str]:
        """Track a request; returns the engine-core ids of its children."""
        parent = _ParentState(request_id, prompt, prompt_token_ids)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        ids = child_request_ids(request_id, params.n)
        for index, child_id in enumerate(ids):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
            completion = CompletionOutput(
                index=index,
                text="",
                token_ids=[],
                cumulative_logprob=None if params.logprobs is None else 0.0,
                logprobs=None if params.logprobs is None else [],
            )
            parent.children[child_id] = _ChildState(index, detok, completion)
            self._child_to_parent[child_id] = request_id
        self._parents[request_id] = parent
        return ids

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def parent_of(self, child_id: str) -> str:
        """The request id of an engine-core id (itself for a request with n = 1, or one no
        longer tracked)."""
        return self._child_to_parent.get(child_id, child_id)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (RequestOutputs of requests that changed, engine-core ids to abort because a
        stop string ended them)."""
        changed: dict[str, _ParentState] = {}
        to_abort: list[str] = []
        now = time.time()
        for out in outputs:
            parent_id = self._child_to_parent.get(out.request_id)
            if parent_id is None:
                continue  # aborted here earlier
            parent = self._parents[parent_id]
            child = parent.children[out.request_id]
            if child.completion.finished:
                continue
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.new_prompt_logprobs is not None and parent.prompt_logprobs is not None:
                room = len(parent.prompt_token_ids) - len(parent.prompt_logprobs)
                rows = self.token_texts.entries(out.new_prompt_logprobs)
                parent.prompt_logprobs.extend(rows[:room])
            if out.pooled is not None:
                parent.pooled = out.pooled
            self._apply(child, out, to_abort)
            _record(parent.metrics, out, now)
            changed[parent_id] = parent
        results = []
        for parent in changed.values():
            if parent.finished:
                parent.metrics.finished_time = now
            results.append(self._make_output(parent))
            if parent.finished:
                self._forget(parent)
        return results, to_abort

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its children's engine-core ids."""
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        self._forget(parent)
        return list(parent.children)

    def _apply(self, child: _ChildState, out: EngineCoreOutput, to_abort: list[str]) -> None:
        comp = child.completion
        comp.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and comp.logprobs is not None:
            comp.logprobs.extend(self.token_texts.entries(out.new_logprobs))
            for values in out.new_logprobs.logprobs:
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + values[0]
        stop = child.detok.update(out.new_token_ids)
        if stop is not None:
            comp.finish_reason, comp.stop_reason = str(FinishReason.STOP), stop
            if not out.finished:
                to_abort.append(out.request_id)
        elif out.finish_reason is not None:
            comp.finish_reason, comp.stop_reason = str(out.finish_reason), out.stop_reason
        comp.text = child.detok.visible_text(comp.finished)

    def _make_output(self, parent: _ParentState) -> RequestOutput:
        completions = sorted(
            (c.completion for c in parent.children.values()), key=lambda c: c.index
        )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[_copy(c) for c in completions],
            finished=parent.finished,
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=None
            if parent.prompt_logprobs is None
            else list(parent.prompt_logprobs),
            metrics=dataclasses.replace(parent.metrics),
            pooled=parent.pooled,
        )

    def _forget(self, parent: _ParentState) -> None:
        self._parents.pop(parent.request_id, None)
        for child_id in parent.children:
            self._child_to_parent.pop(child_id, None)


def _record(metrics: RequestMetrics, out: EngineCoreOutput, now: float) -> None:
    if out.new_token_ids:
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        metrics.num_generation_tokens += len(out.new_token_ids)
    if metrics.time_in_queue is None and (out.queue_time or out.prefill_time):
        metrics.time_in_queue, metrics.prefill_time = out.queue_time, out.prefill_time


def _copy(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        c.index,
        c.text,
        list(c.token_ids),
        c.cumulative_logprob,
        None if c.logprobs is None else list(c.logprobs),
        c.finish_reason,
        c.stop_reason,
    )
