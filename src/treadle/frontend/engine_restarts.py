"""The engine's life in the front end (issue 14, issue 25): each engine's state, what each
detector's report does to it, and the one restart sequence that the client and the
`treadle serve` supervisor share.

    up --died/down--> restarting --back (new process said hello)--> resuming --suspects done--> up
    up --lost (a remote engine does not answer)--> lost (its requests resume on the others)
    lost --rejoined (a remote rank's new engine said hello)--> resuming --> up
    restarting --its restart failed, another engine is not lost--> lost
    up/lost --scale in (`engine_scale.py`)--> draining --drained, or moved--> removed

While `restarting`, new requests for it wait (bounded: `max_waiting`), utility calls to it
fail, and its requests are staged. While `resuming`, the staged requests are sent again one
at a time, each once the one before made progress (the dead-letter rule of `inflight.py`
pins a second death on the one suspect then running, which fails with
`RequestKilledEngineError`).

Detectors (`engine_watch.py`, the supervisor's in `cli/supervise.py`) and what follows; the
mode is `RestartMode`, set once per client:

| detector | sees | reports | action |
|---|---|---|---|
| process sentinel (`ProcessMonitor`), OWN | our engine core exits non-zero | `died` | `restart_child`: spend the budget, `down`, restart the rank, `back`; none left or the restart fails: `lost` while another engine is not (its failed process killed), else the client ends |
| process sentinel, OWN | our DP coordinator exits non-zero | `coordinator_died` | `restart_child` on the same addresses (it holds no request) |
| process sentinel, OFF (or exit 0) | an engine or the coordinator ends | client dead (or stopped) | every request fails, /health 503, exit 1 (stopped: exit 0) |
| `ENGINE_CORE_DEAD` frame, with its sender's proof | an engine raised, or was sent SIGTERM alone (its `DeathReport`) | OFF: client dead | else logged and kept: its exit follows and is reported with it |
| `ENGINE_CORE_STOPPED` frame, with its sender's proof | an engine was asked to stop (SIGUSR1) | client stopped | the server stops cleanly |
| either frame without a proof that holds (`OutputReader`) | another process pushed it | nothing | refused and logged |
| the supervisor's `EngineDied` (`engine_events.py`), FOLLOW | its engine core exited (how, its report, our stall kill) | `down` | new requests wait, its requests are staged (the same `last_death` in every API server) |
| hello of a new launch, FOLLOW | the supervisor restarted it | `down` (if not seen), `back` | staged requests resume one at a time |
| hello of a new launch, OWN | our restart's new process | (ends `restart_child`) | `back` |
| hello of a new launch, OWN or FOLLOW | a lost remote rank's new engine (`engine_rejoin.py`, or the supervisor's `cli/supervised_desk.py`, took its handshake) | `rejoined` | back in the routing |
| peer disconnect + ping | a peer left the request socket and an engine that no process watch here covers does not answer in 10 s | `lost` (FOLLOW: an `EngineLost` to the supervisor, which tells every API server) | its requests resume on the others; OFF or none left: client dead |
| stall watch | requests but no finished step | `stall` | past --engine-stall-timeout not ready; past --engine-stall-kill-timeout killed where this host restarts it (OWN; FOLLOW: the supervisor kills it when asked, `StallKill`), once per process: the sentinel or `EngineDied` reports the death |
| a background task raises | a bug in a reader | client dead | as above |
| supervisor's monitor (`cli/supervise.py`) | its engine core or coordinator exits non-zero | (its own process) | `EngineDied` to every API server, `restart_child` there; the API servers follow (`EngineDied`, hello) |
| supervisor's `EngineLost`, FOLLOW | its restart of an engine failed, others serve; or an API server found a remote engine silent | `lost` | its requests resume on the others |
| `POST /scale` (`engine_scale.py`), OWN | fewer engines asked | (draining) | no new request; drained or moved (`lost`), stopped (another host's: released, its STOPPED awaited), removed; a death meanwhile: `lost` |
| the supervisor's `ScaleStep`/`Scaled` (`scale_follow.py`), FOLLOW | `POST /scale` to any API server | (draining), resize | as OWN's, each step acknowledged to the supervisor, which stops or starts the processes |

`RestartBudget` is --max-engine-restarts in a 10-minute window; the supervisor spends the same
budget when it restarts its engines itself.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from treadle.config import RestartConfig
from treadle.frontend.engine_router import EngineRouter
from treadle.frontend.engine_state import (
    Death,
    EngineSlot,
    EngineState,
    killed_cause,
    lost_cause,
    others_serve,
)
from treadle.frontend.inflight import InFlight
from treadle.frontend.restart_sequence import RestartBudget, restart_child
from treadle.logger import init_logger
from treadle.wire.control import DeathReport
from treadle.wire.engine import EngineCoreOutputs, EngineCoreRequest

logger = init_logger(__name__)


class RestartHost(Protocol):
    """What `EngineRestarts` needs from the client that owns the sockets and processes."""

    inflight: InFlight
    router: EngineRouter
    killable: frozenset[int]
    """The engines that `kill` applies to: on this host, and restarted when they die."""

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

    def kill(self, rank: int) -> None:
        """Kill this host's engine process of `rank` (a stalled one)."""

    async def send_abort(self, rank: int, request_ids: list[str]) -> None: ...

    async def send_add(self, rank: int, request: EngineCoreRequest) -> None: ...

    def fail_calls(self, rank: int, cause: str) -> None:
        """Fail the utility calls waiting for the engine."""

    def fail_poisoned(self, rank: int, request_ids: list[str], cause: str) -> None:
        """End requests the dead-letter rule failed (`RequestKilledEngineError`, saying
        `cause`: how the engine died the second time)."""

    def on_event(self, kind: str, engine: int, count: int) -> None: ...


class EngineRestarts:
    """The state machine of each engine of one client: the detectors report `died` (the
    client restarts it), `down` then `back` (the supervisor restarts it), `lost` or `stall`;
    what follows is the table above. It holds one `EngineSlot` per rank (`slots`, which the
    router and every reader share) and is the only writer of their fields."""

    def __init__(
        self, host: RestartHost, num_engines: int, config: RestartConfig, max_waiting: int
    ) -> None:
        self.host = host
        self.config = config
        self.budget = RestartBudget(config.max_engine_restarts)
        # The router reads the same list (`EngineRouter.slots`): resize adds or drops slots in it.
        self.slots = [EngineSlot(rank) for rank in range(num_engines)]
        self._waiting = 0
        self.max_waiting = max_waiting
        # The supervisor's scale steps (`engine_events.ScaleEvent`), applied by the scaler.
        self.scale_events: Callable[[Any], Awaitable[None]] | None = None

    @property
    def states(self) -> list[EngineState]:
        """Each rank's held state (a copy, to read)."""
        return [slot.state for slot in self.slots]

    # -- what the client asks -------------------------------------------------------------

    def is_up(self, rank: int) -> bool:
        return self.slots[rank].up.is_set()

    def wake_all(self) -> None:
        """The client ended: whoever waits for an engine wakes (and fails)."""
        for slot in self.slots:
            slot.up.set()

    def started(self, pids: list[int], first: int = 0) -> None:
        """The processes of engines `first`.., as each said at start-up (0: not known)."""
        for slot, pid in zip(self.slots[first:], pids, strict=False):
            slot.pid = pid

    def new_launch(self, rank: int, pid: int) -> None:
        """A new process of `rank` said hello."""
        slot = self.slots[rank]
        slot.pid, slot.launch = pid, slot.launch + 1

    def note_report(self, rank: int, report: DeathReport, final: bool = False) -> None:
        """The engine's own death report: its death, seen next, is reported with it
        (`final`: nobody restarts it, the client ends with it)."""
        self.slots[rank].report = report
        if final:
            self.slots[rank].last_death = Death(f"EngineCore_DP{rank} failed", report)

    def ping(self, rank: int, sent: bool) -> None:
        """A health ping to `rank` was sent (`sent`), or answered or failed (its rank may be
        gone by then: scaled in)."""
        if rank < len(self.slots):
            self.slots[rank].ping_sent = time.monotonic() if sent else None

    def pid_of(self, rank: int) -> int:
        return self.slots[rank].pid

    def take_report(self, rank: int) -> DeathReport | None:
        slot = self.slots[rank]
        report, slot.report = slot.report, None
        return report

    async def wait_up(self, rank: int) -> None:
        """Wait for a restarting engine; `OverflowError` when too many wait already."""
        if self._waiting >= self.max_waiting:
            raise OverflowError(
                f"engine core {rank} is restarting and {self._waiting} requests wait for it "
                "already: try again in a few seconds"
            )
        self._waiting += 1
        try:
            await self.slots[rank].up.wait()
        finally:
            self._waiting -= 1

    def readiness(self) -> str | None:
        """None when every engine is up and makes progress; else why not (for /health/ready:
        a lost engine keeps it 503, the others still serve). An engine that resumes its
        requests is up: it takes new ones, and makes progress (else it is stalled)."""
        for slot in self.slots:
            if slot.state is EngineState.DRAINING:  # (leaving: the others serve)
                continue
            if not slot.state.serves:
                return f"engine core {slot.rank} is {slot.state}"
            if slot.stalled:
                idle = time.monotonic() - slot.last_progress
                return f"engine core {slot.rank} has requests but finished no step for {idle:.0f} s"
        return None

    def on_send(self, rank: int) -> None:
        """A request is about to go to the engine: if it had none, its work starts now."""
        if self.host.inflight.count(rank) == 0:
            self.slots[rank].last_progress = time.monotonic()

    async def on_outputs(self, item: EngineCoreOutputs, progressed: list[str]) -> None:
        """Outputs of a step: the engine made progress when the step finished (its
        timestamp: a front end that falls behind must not hide a stopped engine), and the
        suspect on probation may have."""
        slot = self.slots[item.engine_index]
        lag = max(0.0, time.time() - item.timestamp) if item.timestamp else 0.0
        slot.last_progress = max(slot.last_progress, time.monotonic() - lag)
        if slot.probation is not None and slot.probation in progressed:
            await self._release_next(slot.rank)

    async def on_abort(self, request_ids: list[str]) -> None:
        for slot in self.slots:
            if slot.probation is not None and slot.probation in request_ids:
                await self._release_next(slot.rank)

    # -- reports: deaths and returns ------------------------------------------------------

    def died(self, rank: int, death: Death) -> None:
        """Our engine process died: restart it if the budget allows, else end the client.
        Its log line, `/topology` and the requests it fails say why (`Death.describe`)."""
        slot = self.slots[rank]
        if self.host.ended or slot.state is EngineState.LOST:
            return  # (a lost engine's failed restart, killed)
        if slot.state is EngineState.DRAINING:  # (being removed: not started again)
            lost = Death(f"{death.cause} while it was drained", death.report, death.time)
            self.host.spawn(self.lost([rank], lost), f"loss of engine core {rank}")
            return
        if slot.kill_cause is not None:
            death = Death(killed_cause(slot.kill_cause, death.cause), death.report, death.time)
        slot.last_death = death
        cause = death.describe()
        sequence = restart_child(
            f"EngineCore_DP{rank}",
            cause,
            self.budget,
            lambda: self.host.respawn(rank),
            lambda why: self._restart_failed(rank, why),
            down=lambda message: self.down(rank, message, death),
            back=lambda took: self.back(rank, f"{took:.1f} s after it died"),
        )
        if sequence is not None:
            self.host.spawn(sequence, f"restart of engine core {rank}")

    def _restart_failed(self, rank: int, why: str) -> None:
        """Our engine could not be started again (its restart failed, or the budget is
        spent): while another engine is not lost it is `lost` as a remote one is (its
        requests resume on the others, its failed process is killed); else the client ends."""
        if self.host.ended:
            return
        lost = {s.rank for s in self.slots if s.state is EngineState.LOST}
        if not others_serve(rank, len(self.slots), lost):
            self.host.fail(why)
            return
        before = self.slots[rank].last_death
        report = before.report if before is not None else None
        death = Death(lost_cause(why, rank), report)
        moved = {rank: self._out(rank, death)}  # (lost before its killed process is reported)
        if rank in self.host.killable:
            self.host.kill(rank)
        self.host.spawn(self._move(moved), f"loss of engine core {rank}")

    def down(self, rank: int, cause: str, death: Death | None = None) -> None:
        """The engine is gone: new requests wait for it, calls to it fail, and its requests
        are staged to resume, but those the dead-letter rule (`InFlight.on_engine_death`)
        fails: in flight at a death before without progress since."""
        slot = self.slots[rank]
        slot.kill_cause = None  # (its next process may stall too)
        slot.state = EngineState.RESTARTING
        slot.up.clear()
        slot.staged.clear()
        if death is not None:
            slot.last_death = death
        slot.staged.extend(self._take_requests(rank, cause, death))

    async def lost(self, ranks: list[int], death: Death | None = None) -> None:
        """Engines nobody here can start again (on another host, `--headless`; `death` says
        why, else they did not answer) are gone: they get no new request (one sent to them
        alone, `X-data-parallel-rank`, fails), what they still send is dropped, and their
        requests resume on the engines left, one at a time on each as after a restart (each
        is a suspect: it may be what ended that host). One that is lost already is left as
        it is. A new engine of that rank may join later (`rejoined`)."""
        moved = {  # every one of them out of the routing before any request moves
            rank: self._out(
                rank, death or Death(f"EngineCore_DP{rank} does not answer; it is lost")
            )
            for rank in ranks
            if self.slots[rank].state is not EngineState.LOST
        }
        await self._move(moved)

    def _out(self, rank: int, death: Death) -> list[str]:
        """Mark the engine lost; returns its requests, to move."""
        slot = self.slots[rank]
        slot.state = EngineState.LOST
        slot.up.set()  # (whoever waits for it fails in the client)
        slot.staged.clear()  # (a restarting one's: they are in flight, taken next)
        slot.last_death = death
        return self._take_requests(rank, death.cause, death)

    async def _move(self, moved: dict[int, list[str]]) -> None:
        host = self.host
        for rank, rids in moved.items():
            await host.send_abort(rank, rids)  # in case it still runs them after all
            for rid in rids:
                host.router.owners([rid])
                target = host.router.route(host.inflight.requests[rid].request, None)
                host.inflight.move(rid, target)
                self.slots[target].staged.append(rid)
        for slot in self.slots:
            if slot.state is EngineState.UP and slot.staged and slot.probation is None:
                await self._release_next(slot.rank)  # (a restarting one releases them when back)

    async def rejoined(self, rank: int) -> None:
        """A new engine of a lost rank (another host's, started again there) said hello:
        it takes requests again."""
        await self.back(rank, "(it rejoined)")

    def _take_requests(self, rank: int, cause: str, death: Death | None) -> list[str]:
        """The engine's requests to resume; fails those in flight at a death before it."""
        host = self.host
        self.slots[rank].stalled = False
        self.slots[rank].probation = None
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
            host.fail_poisoned(rank, poisoned, death.describe() if death else cause)
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
            len(self.slots[rank].staged),
        )
        self.host.on_event("restarted", rank, 1)
        slot = self.slots[rank]
        slot.state = EngineState.RESUMING
        slot.last_progress = time.monotonic()
        slot.up.set()  # new requests go to it again
        await self._release_next(rank)

    async def _release_next(self, rank: int) -> None:
        """Resume the next suspect of a restarted engine: one at a time, each once the one
        before made progress, so that a request that kills the engine again is the only one
        in flight at that second death."""
        slot = self.slots[rank]
        while slot.staged:
            request = self.host.inflight.resumed(slot.staged.popleft())
            if request is None:  # it was aborted meanwhile
                continue
            slot.probation = request.request_id
            await self.host.send_add(rank, request)
            self.host.on_event("resumed", rank, 1)
            return
        slot.probation = None
        if slot.state is EngineState.RESUMING:
            slot.state = EngineState.UP

    def coordinator_died(self, cause: str) -> None:
        """The DP coordinator holds no request: a new one binds the same addresses, and the
        engines and front ends reconnect to it (their zmq sockets retry). Until then requests
        are routed on the client's own counts."""
        if self.host.ended:
            return
        sequence = restart_child(
            "DPCoordinator", cause, self.budget, self.host.respawn_coordinator, self.host.fail
        )
        if sequence is not None:
            self.host.spawn(sequence, "restart of the DP coordinator")

    def resize(self, n: int) -> None:
        """Engines added (up, with nothing in flight) or the highest removed (drained or
        lost: nothing in flight) by `POST /scale`: slots added or dropped."""
        del self.slots[n:]
        self.slots.extend(EngineSlot(rank) for rank in range(len(self.slots), n))

    async def on_scale(self, event: Any) -> None:
        """A step of a scale that the supervisor runs (`frontend/scale_follow.py`)."""
        if self.scale_events is not None:
            await self.scale_events(event)

    def drain(self, ranks: range) -> None:
        """`POST /scale` removes these: no new request goes to them (a lost one stays lost)."""
        for rank in ranks:
            if self.slots[rank].state is not EngineState.LOST:
                self.slots[rank].state = EngineState.DRAINING

    # -- reports: stalls ------------------------------------------------------------------

    def stall(self, rank: int, idle: float | None) -> None:
        """(The stall watch, each quarter second.) Engine `rank` has had requests for `idle`
        s without finishing a step (None: it has none, or does not serve). Past
        --engine-stall-timeout it is not ready (logged once); past
        --engine-stall-kill-timeout it is killed where this host restarts it, once per
        process (its death is then reported as any other, with this cause)."""
        cfg, slot = self.config, self.slots[rank]
        if idle is None or idle <= cfg.engine_stall_timeout:
            if idle is None:
                slot.last_progress = time.monotonic()
            elif slot.stalled:
                logger.warning("EngineCore_DP%d finishes steps again", rank)
            slot.stalled = False
            return
        if not slot.stalled:
            slot.stalled = True
            logger.warning(
                "EngineCore_DP%d has %d request(s) in flight but finished no step for "
                "%.0f s: not ready until it does",
                rank,
                self.host.inflight.count(rank),
                idle,
            )
        kill = cfg.engine_stall_kill_timeout
        if kill > 0 and idle > kill and rank in self.host.killable and slot.kill_cause is None:
            slot.kill_cause = f"EngineCore_DP{rank} finished no step for {idle:.0f} s"
            logger.error("%s: killing it", slot.kill_cause)
            self.host.kill(rank)
