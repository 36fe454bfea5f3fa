"""One engine's life between processes (issue 43): the typed events that the `treadle serve`
supervisor and its API servers send each other, and the rules they share.

    API server i --PUSH (its own ipc file)--> supervisor's PULL   (what an API server saw)
    supervisor --PUB--> every API server's SUB                    (what every API server applies)

The supervisor starts and restarts the engines, so it is the one that says what happened to
one: `EngineDied` (its process exited: how, with the engine's own report and the stall that
made us kill it, if any) and `EngineLost` (its restart failed while others serve, or an API
server found it silent). Each is published once, and every API server applies it through
`apply` (one call per event; `EventCounts` counts them, `/topology` shows the counts). An
API server tells the supervisor what only it can see: `EngineRaised` (the engine's death
report, which comes on the API servers' output sockets), `StallKill` (an engine with
requests and no step: the supervisor kills it, and its death says why) and `EngineLost` (a
remote engine that does not answer; the supervisor publishes it to all). Nothing is sent
again on a timer: an API server that starts late (a restarted one) sends `Ask` until the
supervisor answers with `Known` (the engines lost so far).

An engine's return is each API server's own fact: the new launch's hello on its request
socket (`EngineWatch.on_new_launch`). With one API server there is no supervisor: its own
detectors report to its state machine directly (`engine_watch.py`).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Annotated, Final, Protocol

import msgspec

from treadle.frontend.engine_state import Death, EngineState
from treadle.wire.control import MAX_ERROR_CHARS, MAX_LINE_CHARS, DeathReport

REPORT_WAIT_S: Final = 2.0
"""How long an engine's exit 1 waits for its death report (sent just before it exits): 0.5 s
was too short on a loaded machine (CI saw a raise restarted as a bare exit 1). The API
server that restarts its own engines and the supervisor both wait this long."""

_Cause = Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS + 2 * MAX_LINE_CHARS)]
_Rank = Annotated[int, msgspec.Meta(ge=0, le=4096)]


class EngineDied(msgspec.Struct, tag="died", forbid_unknown_fields=True):
    """Supervisor -> API servers: the process `pid` of engine `rank` exited; the supervisor
    restarts it (within its budget: else an `EngineLost` or the server's end follows)."""

    rank: _Rank
    pid: int
    cause: _Cause  # `engine_state.death_cause`
    report: DeathReport | None = None
    time: float = 0.0

    def death(self) -> Death:
        return Death(self.cause, self.report, self.time)


class EngineLost(msgspec.Struct, tag="lost", forbid_unknown_fields=True):
    """Nobody can start engine `rank` again here (its restart failed while others serve), or
    it does not answer (another host's): its requests resume on the others. An API server
    sends it to the supervisor, which publishes it to all."""

    rank: _Rank
    cause: _Cause
    report: DeathReport | None = None
    time: float = 0.0

    def death(self) -> Death:
        return Death(self.cause, self.report, self.time)


class EngineRaised(msgspec.Struct, tag="raised", forbid_unknown_fields=True):
    """API server -> supervisor: the engine's own death report (`ENGINE_CORE_DEAD`); its
    exit follows, and the `EngineDied` quotes it."""

    report: DeathReport


class StallKill(msgspec.Struct, tag="stall", forbid_unknown_fields=True):
    """API server -> supervisor: engine `rank` (process `pid`) has requests and finished no
    step for --engine-stall-kill-timeout: kill it (once per process); its death says why."""

    rank: _Rank
    pid: int
    cause: _Cause


class Ask(msgspec.Struct, tag="ask", forbid_unknown_fields=True):
    """API server -> supervisor, once at its start (again until answered): what is known."""

    client_index: int


class Known(msgspec.Struct, tag="known", forbid_unknown_fields=True):
    """Supervisor -> API servers, the answer to `Ask`: the engines lost so far."""

    lost: list[EngineLost]


class ScaleAsk(msgspec.Struct, tag="scale_ask", forbid_unknown_fields=True):
    """API server -> supervisor: `POST /scale` came here; run `size` engines
    (`frontend/scale_events.py` tells the steps)."""

    client_index: int
    size: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    drain_timeout: float


class ScaleStep(msgspec.Struct, tag="scale_step", forbid_unknown_fields=True):
    """Supervisor -> API servers, a step before `Scaled`, which each acknowledges
    (`ScaleAck`): `admit` (ranks up to `size` may say hello) or `drain` (ranks from `size`
    up take no new request; what they run ends there within `drain_timeout`, or moves)."""

    step: str
    size: _Rank
    drain_timeout: float = 0.0


class ScaleAck(msgspec.Struct, tag="scale_ack", forbid_unknown_fields=True):
    """API server -> supervisor: `step` (a `ScaleStep`'s, or "scaled") is done here."""

    client_index: int
    step: str
    size: _Rank


class Scaled(msgspec.Struct, tag="scaled", forbid_unknown_fields=True):
    """Supervisor -> API servers: the engines are now ranks 0..`size`-1 (from `old`; `pids`:
    the new ranks' processes). Each API server resizes its slots, router and loggers."""

    old: _Rank
    size: _Rank
    pids: list[int] = []


class ScaleEnded(msgspec.Struct, tag="scale_end", forbid_unknown_fields=True):
    """Supervisor -> API servers: the scale that API server `client_index` asked for is done
    (every API server applied it), or refused or failed (`error`; `busy`: try later)."""

    client_index: int
    old: int
    size: int
    error: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)] = ""
    busy: bool = False


ScaleEvent = ScaleStep | Scaled | ScaleEnded
EngineEvent = (
    EngineDied
    | EngineLost
    | EngineRaised
    | StallKill
    | Ask
    | Known
    | ScaleAsk
    | ScaleStep
    | ScaleAck
    | Scaled
    | ScaleEnded
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EngineEvent)


def encode(event: EngineEvent) -> bytes:
    return _encoder.encode(event)


def decode(payload: bytes) -> EngineEvent:
    """Raises (`msgspec.DecodeError`, `ValidationError`) on anything malformed."""
    if len(payload) > 64 * 1024 + 64 * MAX_ERROR_CHARS:
        raise ValueError(f"an engine event of {len(payload)} bytes is too large")
    return _decoder.decode(payload)


class Applier(Protocol):
    """What `apply` drives: an API server's state machine (`EngineRestarts`)."""

    @property
    def states(self) -> list[EngineState]: ...

    def pid_of(self, rank: int) -> int: ...

    def take_report(self, rank: int) -> DeathReport | None: ...

    def down(self, rank: int, cause: str, death: Death | None = None) -> None: ...

    async def lost(self, ranks: list[int], death: Death | None = None) -> None: ...

    async def on_scale(self, event: ScaleEvent) -> None: ...


class EventCounts:
    """How many events of each kind this process applied (`/topology`: `events`)."""

    def __init__(self) -> None:
        self.applied: Counter[str] = Counter()

    def to_json(self) -> dict[str, int]:
        return dict(sorted(self.applied.items()))


async def apply(event: EngineEvent, machine: Applier, counts: EventCounts) -> None:
    """An API server applies what its supervisor published (the same code in each); each
    `EngineDied` and `EngineLost` is counted once, what a `Known` repeats is not."""
    if isinstance(event, Known):
        for lost in event.lost:
            await _lost(lost, machine)
    elif isinstance(event, EngineDied):
        counts.applied["died"] += 1
        _died(event, machine)
    elif isinstance(event, EngineLost):
        counts.applied["lost"] += 1
        await _lost(event, machine)
    elif isinstance(event, ScaleStep | Scaled | ScaleEnded):
        if isinstance(event, Scaled):
            counts.applied["scaled"] += 1
        await machine.on_scale(event)


def _died(event: EngineDied, machine: Applier) -> None:
    rank = event.rank
    if rank >= len(machine.states):
        return  # (removed since)
    # Not one seen already, nor a death of a process replaced since (its hello came first).
    state, pid = machine.states[rank], machine.pid_of(rank)
    if state in (EngineState.RESTARTING, EngineState.LOST) or pid not in (0, event.pid):
        return
    report = event.report or machine.take_report(rank)
    death = Death(event.cause, report, event.time or time.time())
    machine.down(rank, f"{death.describe()}; its supervisor restarts it", death)


async def _lost(event: EngineLost, machine: Applier) -> None:
    rank = event.rank
    if rank < len(machine.states) and machine.states[rank] is not EngineState.LOST:
        report = event.report or machine.take_report(rank)
        await machine.lost([rank], Death(event.cause, report, event.time or time.time()))
