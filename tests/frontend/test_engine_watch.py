"""`EngineWatch.on_control_frame`: an engine's death report is what the client says when it
ends (restarts off), and is kept for the death that follows (restarts on)."""

from __future__ import annotations

import asyncio
import gc
import warnings
from types import SimpleNamespace
from typing import Any

from treadle.config import RestartConfig
from treadle.frontend.engine_restarts import EngineRestarts
from treadle.frontend.engine_router import EngineRouter
from treadle.frontend.engine_state import RestartMode
from treadle.frontend.engine_watch import EngineWatch
from treadle.wire.control import ENGINE_CORE_DEAD, DeathReport

REPORT = DeathReport(1, "RuntimeError: boom", ["engine_core.py:210 in step"])


class Client:
    launcher = None
    inflight: Any = None
    ended = False

    def __init__(self) -> None:
        self.failed: list[str] = []

    def fail(self, reason: str) -> None:
        self.failed.append(reason)

    def stop(self, reason: str) -> None: ...

    async def call_utility(self, method: str, *args: Any, engine: int = 0) -> Any: ...


def watch(mode: RestartMode) -> tuple[EngineWatch, Client, Any]:
    host = SimpleNamespace(router=EngineRouter(2))
    client, restarts = Client(), EngineRestarts(host, 2, RestartConfig(), max_waiting=8)  # type: ignore[arg-type]
    return EngineWatch(client, restarts, mode, range(2), 2, True), client, restarts  # type: ignore[arg-type]


def test_restarts_off_the_client_ends_saying_what_the_engine_raised() -> None:
    w, client, restarts = watch(RestartMode.OFF)
    assert w.on_control_frame(REPORT) is False
    assert client.failed == [
        "EngineCore_DP1 failed: RuntimeError: boom (at engine_core.py:210 in step)"
    ]
    assert restarts.slots[1].last_death.report == REPORT
    w, client, _ = watch(RestartMode.OFF)
    assert w.on_control_frame(ENGINE_CORE_DEAD) is False  # (no report: the bare frame)
    assert client.failed == ["an engine core reported a fatal error (see its log)"]


def test_restarts_on_the_report_waits_for_the_death() -> None:
    w, client, restarts = watch(RestartMode.OWN)
    assert w.on_control_frame(REPORT) is True
    assert client.failed == [] and [s.report for s in restarts.slots] == [None, REPORT]
    assert restarts.slots[1].last_death is None


def test_a_death_seen_after_the_loop_closed_restarts_nothing() -> None:
    """(The process monitor's thread, after the server's loop has closed.) No restart is
    scheduled on the closed loop, no coroutine is left unawaited: the client ends."""
    w, client, _ = watch(RestartMode.OWN)
    engine = SimpleNamespace(name="EngineCore_DP1", exitcode=-9, describe=lambda: "EngineCore_DP1")
    client.launcher = SimpleNamespace(coordinator=None, engines=[None, engine], start_rank=0)  # type: ignore[assignment]
    loop = asyncio.new_event_loop()
    loop.close()
    w.loop, w.tasks = loop, SimpleNamespace(spawn=None)  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ("coroutine ... was never awaited" fails the test)
        assert w.on_child_death(engine) is False  # type: ignore[arg-type]
        gc.collect()
