"""An API server's side of the engine events with its `treadle serve` supervisor
(`engine_events.py` draws the channels): a PUSH bound on an ipc file of its own, which the
supervisor's PULL connects to, for what this API server saw."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import zmq

from treadle.frontend.engine_events import EngineEvent, encode


def reports_address(notes: str) -> str:
    """Where an API server of a supervisor binds the PUSH of its engine events (one frame:
    an `EngineEvent`); the supervisor's PULL connects. Beside its notes' SUB."""
    return f"{notes}-reports"


class SupervisorReports:
    """An API server's PUSH to its supervisor. The supervisor's PULL connects moments after
    this binds (ipc reconnects every 0.1 s), and an engine may die at once: what cannot go yet
    (`zmq.Again`, no peer) waits, in order, and is tried again every 0.1 s (the supervisor
    waits `REPORT_WAIT_S` for a death report before it says the engine died)."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock
        self.unsent: collections.deque[bytes] = collections.deque(maxlen=16)

    def send(self, event: EngineEvent) -> None:
        self.unsent.append(encode(event))
        self._flush()

    def _flush(self) -> None:
        while self.unsent:
            try:
                self.sock.send(self.unsent[0], zmq.NOBLOCK)
            except zmq.Again:  # (no supervisor yet; or gone, and nobody needs it)
                return
            self.unsent.popleft()

    async def retry(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self._flush()
