"""`StartupProgress`: each engine's start-up phase, as `/health/startup` and `/topology` say it."""

from __future__ import annotations

from treadle.frontend.startup import StartupProgress
from treadle.wire.control import StartupPhase


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
