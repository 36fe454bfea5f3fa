"""core/engine_stop.py: a SIGTERM/SIGINT that no front end's SIGUSR1 follows is a death; one
that it follows (Ctrl-C to the process group) is a clean stop."""

from __future__ import annotations

import logging
import signal

import pytest

from treadle.core import engine_stop
from treadle.core.engine_stop import ASK_GRACE_S, Shutdown, StoppedUnasked

LOG = logging.getLogger("treadle.test")


def test_a_signal_alone_is_a_death_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(engine_stop.time, "monotonic", lambda: now[0])
    alone, group = Shutdown(running=True), Shutdown(running=True)
    for shutdown in (alone, group):
        shutdown.on_signal(signal.SIGTERM, None, LOG)
        assert not shutdown.requested  # it serves on meanwhile
        shutdown.check_unasked()
    group.on_signal(signal.SIGUSR1, None, LOG)  # its front end asks
    assert group.requested
    now[0] += ASK_GRACE_S + 0.1
    group.check_unasked()
    with pytest.raises(StoppedUnasked, match="SIGTERM was sent to this engine core alone"):
        alone.check_unasked()
    again = Shutdown(running=True)
    again.on_signal(signal.SIGTERM, None, LOG)
    again.on_signal(signal.SIGTERM, None, LOG)  # a second one unasked: a death now
    with pytest.raises(StoppedUnasked):
        again.check_unasked()
    with pytest.raises(SystemExit) as exited:  # a third: at once, as a death
        again.on_signal(signal.SIGTERM, None, LOG)
    assert exited.value.code == 1
    group.on_signal(signal.SIGINT, None, LOG)
    with pytest.raises(SystemExit) as exited:
        group.on_signal(signal.SIGINT, None, LOG)
    assert exited.value.code == 0
