"""The words of an engine's life, as the front end uses them: each engine's record
(`EngineSlot`: its held state and what goes with it), what `/topology` shows of it
(`ShownState`), who restarts this client's engines, and what is known of its last death (the
table of what happens when is in `engine_restarts.py`, the only module that writes a slot).

The enums are `str`-valued, so log lines, `/topology` and the dashboard carry the same
strings as before (`f"{state}"` is its value; so is its JSON).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from treadle.ipc.process import describe_exit
from treadle.wire.control import DeathReport


class EngineState(StrEnum):
    """One engine's held state (`EngineSlot.state`); `/topology` and the dashboard show what
    is derived from it (`ShownState.of`)."""

    UP = "up"
    """Takes requests, and makes progress (or has none)."""
    RESTARTING = "restarting"
    """Its process died: new requests wait for it, its requests are staged to resume."""
    RESUMING = "resuming"
    """Its new process said hello; its staged requests are sent again, one at a time."""
    LOST = "lost"
    """Nobody here can start it again (another host, or ours whose restart failed): out of
    the routing for good."""
    DRAINING = "draining"
    """Being removed (`POST /scale`, `engine_scale.py`): it gets no new request; those it has
    finish there, or move to the others after the drain timeout."""

    @property
    def serves(self) -> bool:
        """Up or resuming: it takes requests, and answers calls."""
        return self in (EngineState.UP, EngineState.RESUMING)


class ShownState(StrEnum):
    """What `/topology` and the dashboard show of an engine (and of its processes)."""

    STARTING = "starting"
    """(For processes.) An engine process whose engine has not reported yet."""
    READY = "ready"
    """Up or resuming, and making progress."""
    STALLED = "stalled"
    """It has requests but finished no step for --engine-stall-timeout."""
    RESTARTING = "restarting"
    LOST = "lost"
    DRAINING = "draining"
    DEAD = "dead"
    """The client ended: no restart left, or restarts off."""

    @classmethod
    def of(cls, slot: EngineSlot, client_dead: bool) -> ShownState:
        if client_dead:
            return cls.DEAD
        if slot.state.serves:  # (up, or resuming: it takes requests and makes progress)
            return cls.STALLED if slot.stalled else cls.READY
        return cls(slot.state.value)


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@dataclass(eq=False)
class EngineSlot:
    """Everything the front end holds of one engine rank. Only the engine-life state machine
    (`engine_restarts.py`) writes its fields (`tests/frontend/test_engine_slots.py` reads the
    code for it); every other module reads them. Resize is adding or dropping slots."""

    rank: int
    state: EngineState = EngineState.UP
    pid: int = 0
    """Its engine core's process (0: not known, or on another host)."""
    launch: int = 1
    """Its launch number: 1 at start-up, one more at each new process that said hello."""
    stalled: bool = False
    """It has requests but finished no step for --engine-stall-timeout."""
    last_progress: float = field(default_factory=time.monotonic)
    """When it last finished a step (or got its first request after being idle)."""
    last_death: Death | None = None
    """For `/topology` and the errors of what it failed."""
    report: DeathReport | None = None
    """Its own death report (`ENGINE_CORE_DEAD`), kept until its death is seen."""
    kill_cause: str | None = None
    """Why we killed its process (a stall), until its death is seen."""
    probation: str | None = None
    """The resumed request whose progress releases the next one."""
    staged: collections.deque[str] = field(default_factory=collections.deque)
    """Requests to resume on it, one at a time."""
    up: asyncio.Event = field(default_factory=_set_event)
    """Set while new requests may go to it (clear while it restarts)."""
    ping_sent: float | None = None
    """When its unanswered health ping was sent (None: none is unanswered)."""

    @property
    def down(self) -> bool:
        """The router chooses it only when every engine is down (restarting, lost, leaving)."""
        return not self.state.serves

    @property
    def gone(self) -> bool:
        """The router never chooses it (lost, or leaving)."""
        return self.state in (EngineState.LOST, EngineState.DRAINING)


class RestartMode(StrEnum):
    """Who starts this client's engines again when they die: set once, at construction, from
    who started them (this client, or the `treadle serve` supervisor) and
    `--max-engine-restarts`. Engines on another host (`--headless`) are started again by
    nobody here: with restarts on they become `lost` when they go silent."""

    OWN = "own"
    """This client started its engines and restarts them (one API server)."""
    FOLLOW = "follow"
    """The supervisor started and restarts them (several API servers); this client sees a
    death by the pid and the return by the new process's hello, and resumes its requests."""
    OFF = "off"
    """Nobody (`--max-engine-restarts 0`): an engine's death ends the client."""

    @classmethod
    def of(cls, started_here: bool, max_engine_restarts: int) -> RestartMode:
        if max_engine_restarts == 0:
            return cls.OFF
        return cls.OWN if started_here else cls.FOLLOW


@dataclass(frozen=True)
class Death:
    """One death of an engine, as its restart log line, `/topology` (`last_death`) and the
    error of a request it failed say it: how it ended, as the detector saw it (an exit code or
    signal, a stall kill, a silence), and the engine's own report when it raised."""

    cause: str  # e.g. "the EngineCore_DP0 process died: exit code 1"
    report: DeathReport | None = None
    time: float = field(default_factory=time.time)

    def describe(self) -> str:
        """The cause, and what the engine raised: "...: exit code 1; it raised
        RuntimeError: boom (at engine_core.py:210 in step)"."""
        if self.report is None:
            return self.cause
        return f"{self.cause}; it raised {self.report.describe()}"

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"time": self.time, "cause": self.cause}
        if self.report is not None:
            entry.update(
                error=self.report.error,
                frames=self.report.frames,
                log_tail=self.report.log_tail,
            )
        return entry


# How a death is said, in the words of every log line, `/topology` and failed request (one
# place, for the API server that restarts its own engines and for the supervisor).


def death_cause(name: str, exitcode: int | None, kill_cause: str | None = None) -> str:
    """ "the EngineCore_DP0 process died: killed by signal 9 (SIGKILL)"; for one we killed
    because it stalled, `killed_cause` of that."""
    cause = f"the {name} process died: {describe_exit(exitcode)}"
    return cause if kill_cause is None else killed_cause(kill_cause, cause)


def killed_cause(kill_cause: str, cause: str) -> str:
    """ "EngineCore_DP0 finished no step for 31 s: killed (the ... process died: ...)"."""
    return f"{kill_cause}: killed ({cause})"


def lost_cause(why: str, rank: int) -> str:
    """An engine of ours that cannot be started again while others serve."""
    return f"{why}; EngineCore_DP{rank} is lost, the others serve on"


def others_serve(rank: int, num_engines: int, lost: Collection[int]) -> bool:
    """The lost rule: an engine that cannot be started again is `lost` while another engine
    is not (its requests resume on the others); else the server ends."""
    return any(r != rank and r not in lost for r in range(num_engines))
