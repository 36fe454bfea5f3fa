"""How an engine core is asked to stop (ARCHITECTURE §5): what its signal handlers tell the
busy loop (`engine_core_proc.py`).

Whoever stops an engine core on purpose asks with SIGUSR1: its front end (when the API server
is stopped), the `treadle serve` supervisor, a TP worker that was asked to stop. The engine
then lets its requests finish (`--shutdown-timeout`), aborts the rest and answers them, says
ENGINE_CORE_STOPPED and exits 0.

SIGTERM or SIGINT is not such a request by itself: Ctrl-C sends SIGINT to the whole process
group, and the front end's SIGUSR1 follows within moments. One that no SIGUSR1 follows within
`ASK_GRACE_S` was sent to this engine core alone (an operator's `kill`, an orchestrator): the
engine serves on meanwhile, then dies (`StoppedUnasked`: a death report, exit 1) without
aborting anything, so that its front end restarts it and resumes its requests as after
kill -9, instead of the whole server stopping with exit 0; a second such signal does so at
once. Asked, a second signal aborts the running requests, a third exits at once.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import Any

RELEASE = "release_engine"
"""The utility call by which a front end asks its engine core to stop as SIGUSR1 does: one
of another host that `POST /scale` removes (nobody there signals it); it exits 0."""

ASK_GRACE_S = 3.0
"""How long a SIGTERM/SIGINT waits for the front end's SIGUSR1 before it is a death."""


class StoppedUnasked(RuntimeError):
    """A SIGTERM/SIGINT that no front end's SIGUSR1 followed: this engine core dies."""


@dataclass
class Shutdown:
    """What the signal handlers tell the busy loop."""

    signals: int = 0  # SIGTERM/SIGINT received
    asked: bool = False  # asked to stop (SIGUSR1)
    running: bool = False  # the busy loop runs (before it, a signal exits at once)
    first_signal_at: float = 0.0
    first_signal: str = ""

    @property
    def requested(self) -> bool:
        """Asked to stop: the busy loop drains, then stops cleanly."""
        return self.asked

    def check_unasked(self) -> None:
        """Raise `StoppedUnasked` once a signal has waited `ASK_GRACE_S` for no SIGUSR1 (or
        a second one came)."""
        waited = time.monotonic() - self.first_signal_at
        if self.signals and not self.asked and (self.signals >= 2 or waited > ASK_GRACE_S):
            raise StoppedUnasked(
                f"{self.first_signal} was sent to this engine core alone (no front end asked "
                "it to stop): exiting as a death, so that it is restarted and its requests "
                "resume"
            )

    def on_signal(self, signum: int, frame: Any, logger: logging.Logger) -> None:
        sig = signal.Signals(signum).name
        if not self.running:
            logger.info("Received %s while starting; exiting", sig)
            raise SystemExit(0)
        if signum == signal.SIGUSR1:
            self.asked = True
            logger.info("Asked to stop (SIGUSR1, from a front end or a worker); shutting down")
            return
        self.signals += 1
        if self.signals == 1:
            self.first_signal_at, self.first_signal = time.monotonic(), sig
            logger.info(
                "Received %s; stopping once a front end asks (SIGUSR1), else exiting as a "
                "death in %g s",
                sig,
                ASK_GRACE_S,
            )
        elif self.signals == 2:
            then = "aborting the running requests" if self.asked else "exiting as a death"
            logger.info("Received %s again; %s", sig, then)
        else:
            logger.info("Received %s a third time; exiting now", sig)
            raise SystemExit(0 if self.asked else 1)
