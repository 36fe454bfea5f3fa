"""What a front end needs to resume its requests on a restarted engine core (ARCHITECTURE §5,
issue 14): each request as it was sent, the engine it runs on, and what came back so far.

    add(request, engine)            sent
    on_outputs(outputs)             tokens and prompt-logprob rows received (progress: no
                                    longer a suspect); finished ones go
    remove(ids)                     aborted
    on_engine_death(engine)         -> (ids to resume, ids to fail): the dead-letter rule
    move(id, engine)                to resume on another engine (its own is lost)
    resumed(id)                     the request to send again, with what its client has
                                    (sent: a death from now on is one it was in flight at)

The dead-letter rule: a request in flight at an engine death is a suspect; one that is in
flight at a second death before it has made progress on the restarted engine (a token, or
its end) is failed instead of being resumed again, so a request that kills every engine it
meets cannot take the service down in a loop. The client resumes suspects one at a time
(each waits until the one before it has made progress), so a second death can be pinned on
the one suspect then running. Nothing here touches sockets.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import msgspec

from treadle.wire.engine import EngineCoreOutputs, EngineCoreRequest


@dataclass(slots=True, eq=False)
class InFlightRequest:
    request: EngineCoreRequest
    engine: int
    output_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: int = 0  # prompt-logprob rows received
    deaths: int = 0  # engine deaths it has been in flight at, since it last made progress
    sent: bool = True  # on its engine now (False: waiting to be resumed)


class InFlight:
    def __init__(self) -> None:
        self.requests: dict[str, InFlightRequest] = {}
        self._counts: collections.Counter[int] = collections.Counter()  # per engine

    def add(self, request: EngineCoreRequest, engine: int) -> None:
        self._forget(request.request_id)  # (an id sent again replaces the earlier one)
        self.requests[request.request_id] = InFlightRequest(request, engine)
        self._counts[engine] += 1

    def remove(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._forget(rid)

    def _forget(self, request_id: str) -> None:
        entry = self.requests.pop(request_id, None)
        if entry is not None:
            self._counts[entry.engine] -= 1

    def on_outputs(self, outputs: EngineCoreOutputs) -> list[str]:
        """Record what arrived; returns the ids that made progress (a token, or their end)."""
        progressed = []
        for out in outputs.outputs:
            entry = self.requests.get(out.request_id)
            if entry is None:
                continue
            entry.output_token_ids.extend(out.new_token_ids)
            if out.new_prompt_logprobs is not None:
                entry.prompt_logprobs += len(out.new_prompt_logprobs.ranks)
            if out.finished:
                self._forget(out.request_id)
            if out.finished or out.new_token_ids:
                entry.deaths = 0
                progressed.append(out.request_id)
        return progressed

    def count(self, engine: int) -> int:
        """Requests in flight on the engine (O(1): read per request and by the stall watch)."""
        return self._counts[engine]

    def on_engine_death(self, engine: int) -> tuple[list[str], list[str]]:
        """The engine's requests as (to resume, in the order they arrived; to fail: in flight
        at their second death without progress in between). The failed ones are forgotten."""
        resume: list[str] = []
        fail: list[str] = []
        for rid, entry in self.requests.items():
            if entry.engine != engine:
                continue
            if entry.sent:  # one still waiting to be resumed was not there
                entry.deaths += 1
                entry.sent = False
            (fail if entry.deaths >= 2 else resume).append(rid)
        self.remove(fail)
        resume.sort(key=lambda rid: self.requests[rid].request.arrival_time)
        return resume, fail

    def move(self, request_id: str, engine: int) -> None:
        """The request resumes on another engine (its own is lost)."""
        entry = self.requests[request_id]
        self._counts[entry.engine] -= 1
        entry.engine = engine
        self._counts[engine] += 1

    def resumed(self, request_id: str) -> EngineCoreRequest | None:
        """The request to send again (None if it ended meanwhile): its prompt and params as
        first sent, and the outputs and prompt-logprob rows its client has already."""
        entry = self.requests.get(request_id)
        if entry is None:
            return None
        entry.sent = True
        return msgspec.structs.replace(
            entry.request,
            resumed_output_token_ids=list(entry.output_token_ids),
            resumed_prompt_logprobs=entry.prompt_logprobs,
        )
