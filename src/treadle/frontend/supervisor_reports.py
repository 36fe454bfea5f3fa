"""API server 0 -> its `treadle serve` supervisor (`cli/supervised_desk.py` reads them): a
PUSH of its engines' death reports, for the supervisor's restart lines, and of the engines
lost here, every half second."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import msgspec
import zmq


def reports_address(notes: str) -> str:
    """Where API server 0 of a supervisor binds the PUSH of its engines' death reports (one
    frame: a `DeathReport`) and of the engines lost here (`[LOST_ENGINES, EnginesLost]`);
    the supervisor's PULL connects. Beside its notes' SUB."""
    return f"{notes}-reports"


class SupervisorReports:
    """API server 0's PUSH to its supervisor. The supervisor's PULL connects moments after
    this binds (ipc reconnects every 0.1 s), and an engine may die at once: what cannot go yet
    (`zmq.Again`, no peer) waits, in order, and is tried again every 0.1 s (the supervisor
    waits 2 s for a death report before its restart line)."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock
        self.unsent: collections.deque[list[bytes]] = collections.deque(maxlen=16)

    def send(self, parts: list[bytes | msgspec.Struct]) -> None:
        frames = [p if isinstance(p, bytes) else msgspec.msgpack.encode(p) for p in parts]
        self.unsent.append(frames)
        self._flush()

    def _flush(self) -> None:
        while self.unsent:
            try:
                self.sock.send_multipart(self.unsent[0], zmq.NOBLOCK)
            except zmq.Again:  # (no supervisor yet; or gone, and nobody needs it)
                return
            self.unsent.popleft()

    async def retry(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self._flush()
