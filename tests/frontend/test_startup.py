"""`StartupProgress`: each engine's start-up phase, as `/health/startup` and `/topology` say it."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import zmq

from treadle.frontend.startup import StartupProgress, follow_phases
from treadle.wire.control import StartupPhase, StartupPhases


def test_phases_are_described_and_later_reports_ignored_once_finished() -> None:
    progress = StartupProgress(2)
    assert progress.describe() == "starting"
    progress.report(0, StartupPhase.LOADING_WEIGHTS)
    progress.report(1, StartupPhase.LOADING_WEIGHTS)
    assert progress.describe() == "loading weights"
    progress.report(1, StartupPhase.HANDSHAKE)
    progress.report(7, StartupPhase.HANDSHAKE)  # no such rank: ignored
    assert progress.describe() == "engine 0: loading weights, engine 1: handshake"
    progress.finish()
    progress.report(0, StartupPhase.LOADING_WEIGHTS)  # a restart's: `restarting` says it
    assert progress.to_json() == [
        {"dp_rank": 0, "phase": "ready"},
        {"dp_rank": 1, "phase": "ready"},
    ]
    progress.stop()  # no children: nothing to do


def test_an_api_server_follows_the_supervisors_phases_over_a_real_socket(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`follow_phases` binds its SUB, copies each `StartupPhases` it gets, ignores what does not
    decode or has another number of engines, and ends (its ipc file gone) once finished."""
    address = f"ipc://{tmp_path}/notes-startup"
    progress = StartupProgress(2)
    thread = follow_phases(progress, address)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(address)

    def send_until(payload: bytes, seen: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not seen():  # (a PUB drops what it sends before the SUB has joined)
            assert time.monotonic() < deadline, progress.to_json()
            pub.send(payload)
            time.sleep(0.05)

    try:
        phases = [StartupPhase.LOADING_WEIGHTS, StartupPhase.HANDSHAKE]
        send_until(msgspec.msgpack.encode(StartupPhases(phases)), lambda: progress.phases == phases)
        for bad in (
            b"\xc1",  # not msgpack
            msgspec.msgpack.encode([["compiling"]]),  # no such phase
            msgspec.msgpack.encode(StartupPhases([StartupPhase.STARTING] * 3)),  # 3 engines
        ):
            pub.send(bad)
        marker = [StartupPhase.HANDSHAKE, StartupPhase.HANDSHAKE]
        send_until(msgspec.msgpack.encode(StartupPhases(marker)), lambda: progress.phases == marker)
        progress.finish()
        thread.join(5)
        assert not thread.is_alive()
        assert not (tmp_path / "notes-startup").exists()
    finally:
        pub.close()
        ctx.term()
        progress.stop()
        thread.join(5)


def test_a_stop_ends_the_follower_too(tmp_path) -> None:  # type: ignore[no-untyped-def]
    progress = StartupProgress(1)
    thread = follow_phases(progress, f"ipc://{tmp_path}/s")
    progress.stop()
    thread.join(5)
    assert not thread.is_alive() and progress.stopping
