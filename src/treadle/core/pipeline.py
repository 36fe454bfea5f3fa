"""Pipeline parallelism in the engine core: up to `pp` steps in flight (vLLM's
`step_with_batch_queue`) and the sampled tokens that the stages before the last must learn.

The batch queue: while fewer than `pp` steps are in flight and the scheduler has something
to run, schedule and submit one more without waiting; otherwise wait for the oldest and apply
its output. A decoding request is in at most one step in flight: the scheduler advances
`num_computed_tokens` when it schedules, so a request whose last token has not come back has
nothing left to schedule. (Chunks of one prompt may follow each other through the pipeline:
every stage runs the steps in the order they were sent, so its KV is written in order.)
A request aborted or preempted while in flight is safe for the same reason: its blocks can
only be given to a step sent after, which every stage runs after.
"""

from __future__ import annotations

import collections
from typing import Any

from treadle.core.request import Request
from treadle.wire.worker import SchedulerOutput


class TokenFeed:
    """Only the last stage samples; every other stage is told, with each step that schedules
    a request again, the tokens sampled since it last heard of it
    (`CachedRequestData.new_token_ids`)."""

    def __init__(self) -> None:
        self._known: dict[str, int] = {}  # request id -> tokens the stages were sent

    def fill(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        for rid in sched.finished_request_ids:  # finished, aborted or preempted
            self._known.pop(rid, None)
        for new in sched.new_requests:
            self._known[new.request_id] = len(new.token_ids)
        for cached in sched.cached_requests:
            tokens = requests[cached.request_id].all_token_ids
            known = self._known.get(cached.request_id, len(tokens))
            cached.new_token_ids = tokens[known:]
            self._known[cached.request_id] = len(tokens)


class BatchQueue:
    """The steps in flight, oldest first: (its schedule, the executor's pending reply)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.steps: collections.deque[tuple[SchedulerOutput, Any]] = collections.deque()

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def full(self) -> bool:
        return len(self.steps) >= self.size
