"""Engine restarts in the front end (issue 14): a dead engine core is started again with the
same config and rank, and its requests resume where their clients are; an engine that stops
making progress is reported (`/health/ready`), then killed and restarted.

Each engine's state:

    up --death--> restarting --new process says hello--> resuming --suspects done--> up
    up --a remote engine does not answer--> lost (its requests resume on the others)

While `restarting`, new requests for it wait (bounded: `max_waiting`), utility calls to it
fail, and its requests are staged. While `resuming`, the staged requests are sent again one
at a time, each once the one before made progress (the dead-letter rule of `inflight.py`
pins a second death on the one suspect then running).

`RestartBudget` is --max-engine-restarts in a 10-minute window; the `treadle serve` supervisor
(several API servers) spends the same budget when it restarts their engines itself.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Coroutine
from typing import Any, Protocol

import psutil

from treadle.config import RestartConfig
from treadle.frontend.engine_router import EngineRouter
from treadle.frontend.inflight import InFlight
from treadle.logger import init_logger
from treadle.wire.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)

logger = init_logger(__name__)

# --max-engine-restarts counts the restarts in this window.
ENGINE_RESTART_WINDOW_S = 600
POISON_REASON = (
    "the engine core died twice while running this request; it is not resumed again "
    "(it may be what kills the engine)"
)


class RestartBudget:
    """At most `limit` restarts in any ENGINE_RESTART_WINDOW_S."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._times: collections.deque[float] = collections.deque()

    def spend(self, cause: str) -> str | None:
        """Take one restart; returns why not (a message ending in the flag's name) when the
        window's budget is spent, else None (and logs nothing: the caller says what it does)."""
        now = time.monotonic()
        while self._times and now - self._times[0] > ENGINE_RESTART_WINDOW_S:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return (
                f"{cause}; it was restarted {self.limit} time(s) in the last "
                f"{ENGINE_RESTART_WINDOW_S // 60} minutes already (--max-engine-restarts)"
            )
        self._times.append(now)
        return None

    def describe(self) -> str:
        """e.g. "restart 2 of at most 3 in 10 minutes", after `spend`."""
        return (
            f"restart {len(self._times)} of at most {self.limit} in "
            f"{ENGINE_RESTART_WINDOW_S // 60} minutes"
        )


class RestartHost(Protocol):
    """What `EngineRestarts` needs from the client that owns the sockets and processes."""

    inflight: InFlight
    router: EngineRouter

    @property
    def ended(self) -> bool: ...

    def fail(self, reason: str) -> None:
        """End the client: every request fails, the server exits non-zero."""

    def spawn(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        """Run a task whose failure is logged and ends the client."""

    async def respawn(self, rank: int) -> None:
        """Start a new engine process of `rank` and wait for its first message."""

    async def respawn_coordinator(self) -> None:
        """Start a new DP coordinator on the dead one's addresses."""

    def can_kill(self, rank: int) -> bool:
        """Whether `kill(rank)` applies: the engine runs on this host, and is restarted."""

    def kill(self, rank: int) -> None:
        """Kill this host's engine process of `rank` (a stalled one)."""

    async def send_abort(self, rank: int, request_ids: list[str]) -> None: ...

    async def send_add(self, rank: int, request: EngineCoreRequest) -> None: ...

    def fail_calls(self, rank: int, cause: str) -> None:
        """Fail the utility calls waiting for the engine."""

    def on_outputs(self, outputs: EngineCoreOutputs) -> None: ...

    def on_event(self, kind: str, engine: int, count: int) -> None: ...


class EngineRestarts:
    """The restart state of each engine of one client: the client restarts its own engines
    (`died`), or resumes its requests when the supervisor's new engine says hello (`down`,
    then `back`)."""

    def __init__(
        self, host: RestartHost, num_engines: int, config: RestartConfig, max_waiting: int
    ) -> None:
        self.host = host
        self.config = config
        self.budget = RestartBudget(config.max_engine_restarts)
        self.states = ["up"] * num_engines  # up | restarting | resuming
        self.stalled = [False] * num_engines
        self.last_progress = [time.monotonic()] * num_engines
        self._up = [asyncio.Event() for _ in range(num_engines)]
        for event in self._up:
            event.set()
        self._staged: list[collections.deque[str]] = [
            collections.deque() for _ in range(num_engines)
        ]
        self._probation: list[str | None] = [None] * num_engines
        self._kill_cause: dict[int, str] = {}
        self._waiting = 0
        self.max_waiting = max_waiting

    # -- what the client asks -------------------------------------------------------------

    def is_up(self, rank: int) -> bool:
        return self._up[rank].is_set()

    def wake_all(self) -> None:
        """The client ended: whoever waits for an engine wakes (and fails)."""
        for event in self._up:
            event.set()

    async def wait_up(self, rank: int) -> None:
        """Wait for a restarting engine; `OverflowError` when too many wait already."""
        if self._waiting >= self.max_waiting:
            raise OverflowError(
                f"engine core {rank} is restarting and {self._waiting} requests wait for it "
                "already: try again in a few seconds"
            )
        self._waiting += 1
        try:
            await self._up[rank].wait()
        finally:
            self._waiting -= 1

    def readiness(self) -> str | None:
        """None when every engine is up and makes progress; else why not (for /health/ready:
        a lost engine keeps it 503, the others still serve). An engine that resumes its
        requests is up: it takes new ones, and makes progress (else it is stalled)."""
        for rank, state in enumerate(self.states):
            if state not in ("up", "resuming"):
                return f"engine core {rank} is {state}"
            if self.stalled[rank]:
                idle = time.monotonic() - self.last_progress[rank]
                return f"engine core {rank} has requests but finished no step for {idle:.0f} s"
        return None

    def on_send(self, rank: int) -> None:
        """A request is about to go to the engine: if it had none, its work starts now."""
        if self.host.inflight.count(rank) == 0:
            self.last_progress[rank] = time.monotonic()

    async def on_outputs(self, item: EngineCoreOutputs, progressed: list[str]) -> None:
        """Outputs of a step: the engine made progress when the step finished (its
        timestamp: a front end that falls behind must not hide a stopped engine), and the
        suspect on probation may have."""
        rank = item.engine_index
        lag = max(0.0, time.time() - item.timestamp) if item.timestamp else 0.0
        self.last_progress[rank] = max(self.last_progress[rank], time.monotonic() - lag)
        probation = self._probation[rank]
        if probation is not None and probation in progressed:
            await self._release_next(rank)

    async def on_abort(self, request_ids: list[str]) -> None:
        for rank, probation in enumerate(self._probation):
            if probation is not None and probation in request_ids:
                await self._release_next(rank)

    # -- deaths and returns ---------------------------------------------------------------

    def died(self, rank: int, cause: str) -> None:
        """Our engine process died: restart it if the budget allows, else end the client."""
        if self.host.ended:
            return
        cause = self._kill_cause.pop(rank, cause)
        refusal = self.budget.spend(cause)
        if refusal is not None:
            self.host.fail(refusal)
            return
        since = time.monotonic()
        self.down(rank, f"{cause}. Restarting it ({self.budget.describe()})")
        self.host.spawn(self._restart(rank, cause, since), f"restart of engine core {rank}")

    async def _restart(self, rank: int, cause: str, since: float) -> None:
        try:
            await self.host.respawn(rank)
        except Exception as e:
            self.host.fail(f"{cause}, and restarting it failed: {type(e).__name__}: {e}")
            return
        await self.back(rank, f"{time.monotonic() - since:.1f} s after it died")

    def down(self, rank: int, cause: str) -> None:
        """The engine is gone: new requests wait for it, calls to it fail, and its requests
        are staged to resume, but those the dead-letter rule (`InFlight.on_engine_death`)
        fails: in flight at a death before without progress since."""
        self.states[rank] = "restarting"
        self._up[rank].clear()
        self._staged[rank].clear()
        self._staged[rank].extend(self._take_requests(rank, cause))

    async def lost(self, ranks: list[int]) -> None:
        """Engines nobody here can start again (on another host, `--headless`) are gone for
        good: they get no new request (one sent to them alone, `X-data-parallel-rank`, fails),
        what they still send is dropped, and their requests resume on the engines left, one
        at a time on each as after a restart (each is a suspect: it may be what ended that
        host)."""
        host = self.host
        moved: dict[int, list[str]] = {}
        for rank in ranks:  # every one of them out of the routing before any request moves
            self.states[rank] = "lost"
            host.router.gone.add(rank)
            self._up[rank].set()  # (whoever waits for it fails in the client)
            moved[rank] = self._take_requests(
                rank, f"EngineCore_DP{rank} does not answer; it is lost"
            )
        for rank, rids in moved.items():
            await host.send_abort(rank, rids)  # in case it still runs them after all
            for rid in rids:
                host.router.owners([rid])
                target = host.router.route(host.inflight.requests[rid].request, None)
                host.inflight.move(rid, target)
                self._staged[target].append(rid)
        for target, state in enumerate(self.states):
            if state == "up" and self._staged[target] and self._probation[target] is None:
                await self._release_next(target)  # (a restarting one releases them when back)

    def _take_requests(self, rank: int, cause: str) -> list[str]:
        """The engine's requests to resume; fails those in flight at a death before it."""
        host = self.host
        self.stalled[rank] = False
        host.router.down.add(rank)
        self._probation[rank] = None
        host.fail_calls(rank, cause)
        resume, poisoned = host.inflight.on_engine_death(rank)
        logger.warning(
            "%s; %d request(s) to resume%s",
            cause[:1].upper() + cause[1:],
            len(resume),
            f", {len(poisoned)} failed: in flight at two engine deaths in a row"
            if poisoned
            else "",
        )
        if poisoned:
            host.router.owners(poisoned)
            fails = [
                EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, stop_reason=POISON_REASON)
                for rid in poisoned
            ]  # fmt: skip
            host.on_outputs(EngineCoreOutputs(engine_index=rank, outputs=fails))
            host.on_event("poisoned", rank, len(poisoned))
        return resume

    async def back(self, rank: int, when: str) -> None:
        """A new engine core of `rank` is up: new requests go to it, and its staged requests
        resume."""
        if self.host.ended:
            return
        logger.warning(  # a warning, as its death was: a quiet log shows both
            "EngineCore_DP%d is back %s; resuming %d request(s)",
            rank,
            when,
            len(self._staged[rank]),
        )
        self.host.on_event("restarted", rank, 1)
        self.states[rank] = "resuming"
        self.last_progress[rank] = time.monotonic()
        self.host.router.down.discard(rank)
        self._up[rank].set()  # new requests go to it again
        await self._release_next(rank)

    async def _release_next(self, rank: int) -> None:
        """Resume the next suspect of a restarted engine: one at a time, each once the one
        before made progress, so that a request that kills the engine again is the only one
        in flight at that second death."""
        staged = self._staged[rank]
        while staged:
            request = self.host.inflight.resumed(staged.popleft())
            if request is None:  # it was aborted meanwhile
                continue
            self._probation[rank] = request.request_id
            await self.host.send_add(rank, request)
            self.host.on_event("resumed", rank, 1)
            return
        self._probation[rank] = None
        if self.states[rank] == "resuming":
            self.states[rank] = "up"

    def coordinator_died(self, cause: str) -> None:
        """The DP coordinator holds no request: a new one binds the same addresses, and the
        engines and front ends reconnect to it (their zmq sockets retry). Until then requests
        are routed on the client's own counts."""
        if self.host.ended:
            return
        refusal = self.budget.spend(cause)
        if refusal is not None:
            self.host.fail(refusal)
            return
        logger.warning(
            "%s. Restarting it (%s)", cause[:1].upper() + cause[1:], self.budget.describe()
        )
        self.host.spawn(self._restart_coordinator(cause), "restart of the DP coordinator")

    async def _restart_coordinator(self, cause: str) -> None:
        since = time.monotonic()
        try:
            await self.host.respawn_coordinator()
        except Exception as e:
            self.host.fail(f"{cause}, and restarting it failed: {type(e).__name__}: {e}")
            return
        logger.warning("DPCoordinator is back %.1f s after it died", time.monotonic() - since)

    async def watch_processes(self, pids: list[int], ranks: range) -> None:
        """(An API server of the supervisor, on the engines' host.) An engine core whose
        process (`pids[rank]`, kept current by the client) is gone is `restarting` at once:
        /health/ready says so and new requests wait, until the supervisor's new engine says
        hello."""
        processes: dict[int, psutil.Process | None] = {}
        while not self.host.ended:
            await asyncio.sleep(0.25)
            for rank in ranks:
                pid = pids[rank]
                if not pid or self.states[rank] == "restarting":
                    continue
                if pid not in processes:
                    processes[pid] = process_of(pid)
                if not running(processes[pid]):
                    self.down(
                        rank, f"EngineCore_DP{rank} (pid {pid}) is gone; its supervisor restarts it"
                    )

    # -- stalls ---------------------------------------------------------------------------

    async def watch_stalls(self) -> None:
        """An engine with requests that finishes no step for --engine-stall-timeout is not
        ready (logged once); past --engine-stall-kill-timeout it is killed, and restarted."""
        cfg = self.config
        inflight = self.host.inflight
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for rank, state in enumerate(self.states):
                if state in ("restarting", "lost") or inflight.count(rank) == 0:
                    self.last_progress[rank] = now
                    self.stalled[rank] = False
                    continue
                idle = now - self.last_progress[rank]
                if idle <= cfg.engine_stall_timeout:
                    if self.stalled[rank]:
                        logger.warning("EngineCore_DP%d finishes steps again", rank)
                    self.stalled[rank] = False
                    continue
                if not self.stalled[rank]:
                    self.stalled[rank] = True
                    logger.warning(
                        "EngineCore_DP%d has %d request(s) in flight but finished no step for "
                        "%.0f s: not ready until it does",
                        rank,
                        inflight.count(rank),
                        idle,
                    )
                kill = cfg.engine_stall_kill_timeout
                if (
                    kill > 0
                    and idle > kill
                    and self.host.can_kill(rank)
                    and rank not in self._kill_cause
                ):
                    self._kill_cause[rank] = (
                        f"EngineCore_DP{rank} finished no step for {idle:.0f} s"
                    )
                    logger.error("%s: killing it", self._kill_cause[rank])
                    self.host.kill(rank)


def process_of(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def running(process: psutil.Process | None) -> bool:
    """Whether the process runs (not gone, not a zombie, not a new one on a reused pid)."""
    try:
        return (
            process is not None
            and process.is_running()
            and process.status() != psutil.STATUS_ZOMBIE
        )
    except psutil.Error:
        return False
