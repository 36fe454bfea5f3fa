"""`engine_events.py`: the typed events between the supervisor and its API servers, on the
wire and as an API server applies them to its state machine (a real `EngineRestarts`)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from test_engine_restarts import Host

from treadle.config import RestartConfig
from treadle.frontend.engine_events import (
    Ask,
    EngineDied,
    EngineLost,
    EngineRaised,
    EventCounts,
    Known,
    StallKill,
    apply,
    decode,
    encode,
)
from treadle.frontend.engine_restarts import EngineRestarts
from treadle.frontend.engine_state import death_cause
from treadle.wire.control import DeathReport

REPORT = DeathReport(0, "RuntimeError: boom", ["engine_core.py:210 in step"])


def machine(n: int) -> tuple[Host, EngineRestarts]:
    host = Host(n)
    restarts = EngineRestarts(host, n, RestartConfig(), max_waiting=8)
    host.router.slots = restarts.slots
    restarts.started([100 + rank for rank in range(n)])
    return host, restarts


@pytest.mark.parametrize(
    "event",
    [
        EngineDied(0, 100, "the EngineCore_DP0 process died: exit code 1", REPORT, 1.5),
        EngineLost(1, "EngineCore_DP1 does not answer; it is lost"),
        EngineRaised(REPORT),
        StallKill(0, 100, "EngineCore_DP0 finished no step for 31 s"),
        Ask(1),
        Known([EngineLost(1, "lost")]),
    ],
)
def test_each_event_crosses_the_wire_as_itself(event: object) -> None:
    assert decode(encode(event)) == event  # type: ignore[arg-type]


def test_a_malformed_event_is_refused() -> None:
    for payload in (b"", b"\x01", msgspec.msgpack.encode({"type": "died", "rank": -1})):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError, ValueError)):
            decode(payload)
    with pytest.raises(msgspec.ValidationError):  # an unknown kind
        decode(msgspec.msgpack.encode({"type": "reboot", "rank": 0}))


def test_a_death_is_applied_once_and_says_the_same_everywhere() -> None:
    host, restarts = machine(2)
    host.add("a", 0)
    counts = EventCounts()
    cause = death_cause("EngineCore_DP0", -9)
    assert cause == "the EngineCore_DP0 process died: killed by signal 9 (SIGKILL)"
    died = EngineDied(0, 100, cause, None, 1234.0)
    asyncio.run(apply(died, restarts, counts))
    assert restarts.states == ["restarting", "up"]
    death = restarts.slots[0].last_death
    assert death is not None and death.to_json() == {"time": 1234.0, "cause": cause}
    asyncio.run(apply(died, restarts, counts))  # (a second copy changes nothing)
    assert restarts.states == ["restarting", "up"] and counts.to_json() == {"died": 2}
    asyncio.run(restarts.back(0, "(restarted by the supervisor)"))
    restarts.new_launch(0, 200)
    asyncio.run(apply(died, restarts, EventCounts()))  # of the process replaced since
    assert restarts.states[0] in ("up", "resuming") and restarts.slots[0].pid == 200


def test_a_stall_kill_cause_and_the_engines_report_are_quoted() -> None:
    _, restarts = machine(1)
    restarts.note_report(0, REPORT)
    cause = death_cause("EngineCore_DP0", -9, "EngineCore_DP0 finished no step for 31 s")
    assert cause.startswith("EngineCore_DP0 finished no step for 31 s: killed (the ")
    asyncio.run(apply(EngineDied(0, 100, cause), restarts, EventCounts()))
    death = restarts.slots[0].last_death
    assert death is not None and death.report == REPORT and death.cause == cause


def test_a_loss_moves_the_requests_and_a_known_list_is_not_counted() -> None:
    host, restarts = machine(2)
    host.add("a", 1)
    counts = EventCounts()
    lost = EngineLost(1, "restarting it failed; EngineCore_DP1 is lost, the others serve on")
    asyncio.run(apply(lost, restarts, counts))
    assert restarts.states == ["up", "lost"] and host.sent == [(0, "a")]
    asyncio.run(apply(Known([lost]), restarts, counts))  # (a late joiner's answer)
    asyncio.run(apply(Ask(0), restarts, counts))  # (for the supervisor: nothing here)
    assert counts.to_json() == {"lost": 1} and host.sent == [(0, "a")]
    _, late = machine(2)  # an API server that starts after the loss learns it once
    asyncio.run(apply(Known([lost]), late, EventCounts()))
    assert late.states == ["up", "lost"]
