"""The words of an engine's life, as the front end uses them: each engine's state, who
restarts this client's engines, and what is known of its last death (the table of what
happens when is in `engine_restarts.py`).

Both enums are `str`-valued, so log lines, `/topology` and the dashboard carry the same
strings as before (`f"{state}"` is its value; so is its JSON).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from treadle.wire.control import DeathReport


class EngineState(StrEnum):
    """One engine's state. `EngineRestarts` holds one of the first five for each engine;
    `/topology` and the dashboard show what a client sees of it (`AsyncLLM.shown_states`)."""

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

    READY = "ready"
    """(Shown.) Up or resuming, and making progress."""
    STALLED = "stalled"
    """(Shown.) It has requests but finished no step for --engine-stall-timeout."""
    DEAD = "dead"
    """(Shown.) The client ended: no restart left, or restarts off."""
    STARTING = "starting"
    """(Shown, for processes.) An engine process whose engine has not reported yet."""

    @property
    def serves(self) -> bool:
        """Up or resuming: it takes requests, and answers calls."""
        return self in (EngineState.UP, EngineState.RESUMING)


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
