"""Limits on what a socket takes from other processes, and how dropped messages are logged.

Every socket that receives from outside its process (the engine's input DEALERs, the front
end's ROUTER and PULL, the handshake sockets, the DP coordinator's sockets) sets
`ZMQ_MAXMSGSIZE` to `TREADLE_ZMQ_MAX_MSG_BYTES` (64 MiB: a request of the longest prompt any
model takes is a few MiB): libzmq disconnects a peer that sends a larger message part before
buffering it, and a peer that connects again starts afresh. Senders check the same limit
(`check_outbound`) so that treadle never sends what its peer would refuse: a request that is
too large fails at once instead of vanishing with the connection.

The queue of unread messages is bounded by reading: every inbound socket has a reader for
as long as the socket lives (high-water marks stay 0, ARCHITECTURE §2), and what a reader
cannot use is dropped and logged through a `DropLog`, which writes a burst of lines and then
at most one a second, so that a flood of garbage cannot flood the log as well.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import zmq

from treadle import envs

__all__ = ["DropLog", "MessageTooLargeError", "check_outbound", "inbound_options"]


class MessageTooLargeError(ValueError):
    """A message part is larger than TREADLE_ZMQ_MAX_MSG_BYTES: the peer would refuse it."""


def inbound_options() -> dict[int, int]:
    """Socket options (for `make_zmq_socket(options=...)`) of a socket that receives from
    other processes."""
    return {zmq.MAXMSGSIZE: envs.zmq_max_msg_bytes()}


def check_outbound(frames: Sequence[Any], what: str) -> None:
    """Raise `MessageTooLargeError` if a frame of `what` exceeds the peers' limit."""
    limit = envs.zmq_max_msg_bytes()
    for frame in frames:
        size = memoryview(frame).nbytes
        if size > limit:
            raise MessageTooLargeError(
                f"{what} is {size} bytes, more than TREADLE_ZMQ_MAX_MSG_BYTES ({limit})"
            )


class DropLog:
    """Logs dropped messages at ERROR: a burst of up to `burst` lines at once, then one line
    every `interval` seconds at most, which says how many were dropped without a line."""

    def __init__(self, logger: logging.Logger, interval: float = 1.0, burst: int = 10) -> None:
        self.logger = logger
        self.interval = interval
        self.burst = burst
        self.dropped = 0  # in all
        self._tokens = float(burst)
        self._unlogged = 0
        self._last = time.monotonic()

    def drop(self, message: str, *args: Any, exc_info: bool = False) -> None:
        self.dropped += 1
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._last) / self.interval)
        self._last = now
        if self._tokens < 1:
            self._unlogged += 1
            return
        self._tokens -= 1
        if self._unlogged:
            message += f" (and {self._unlogged} more dropped without a line)"
            self._unlogged = 0
        self.logger.error(message, *args, exc_info=exc_info)
