"""`EngineWatch.on_control_frame`: an engine's death report is what the client says when it
ends (restarts off), and is kept for the death that follows (restarts on)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from treadle.frontend.engine_state import RestartMode
from treadle.frontend.engine_watch import EngineWatch
from treadle.wire.control import ENGINE_CORE_DEAD, DeathReport

REPORT = DeathReport(1, "RuntimeError: boom", ["engine_core.py:210 in step"])


class Client:
    launcher = None
    engine_pids = [0, 0]
    inflight: Any = None
    ended = False

    def __init__(self) -> None:
        self.failed: list[str] = []

    def fail(self, reason: str) -> None:
        self.failed.append(reason)

    def stop(self, reason: str) -> None: ...

    async def call_utility(self, method: str, *args: Any, engine: int = 0) -> Any: ...


def watch(mode: RestartMode) -> tuple[EngineWatch, Client, Any]:
    client, restarts = Client(), SimpleNamespace(last_death=[None, None])
    return EngineWatch(client, restarts, mode, range(2), 2, True), client, restarts  # type: ignore[arg-type]


def test_restarts_off_the_client_ends_saying_what_the_engine_raised() -> None:
    w, client, restarts = watch(RestartMode.OFF)
    assert w.on_control_frame(REPORT) is False
    assert client.failed == [
        "EngineCore_DP1 failed: RuntimeError: boom (at engine_core.py:210 in step)"
    ]
    assert restarts.last_death[1].report == REPORT
    w, client, _ = watch(RestartMode.OFF)
    assert w.on_control_frame(ENGINE_CORE_DEAD) is False  # (no report: the bare frame)
    assert client.failed == ["an engine core reported a fatal error (see its log)"]


def test_restarts_on_the_report_waits_for_the_death() -> None:
    w, client, _ = watch(RestartMode.OWN)
    assert w.on_control_frame(REPORT) is True
    assert client.failed == [] and w.reports == {1: REPORT}
