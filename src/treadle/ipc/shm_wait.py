"""How the shared-memory `MessageQueue`'s parties wait on the ring's flags (its layout and
flag states are in `shm_broadcast.py`'s docstring): `RingWaits`, the writer's claim of a free
chunk and its publish, a reader's claim of a written one, and a poll that `shutdown()` wakes.

Waiting. A reader spins (`sched_yield`) for `YIELD_S`, naps in `NAP_S` sleeps until it has
waited `PARK_AFTER_S`, then parks on a notify socket (XPUB with SNDHWM=1 -> SUB with CONFLATE=1,
so at most one wake-up is ever queued), re-checking the flags at least every `RECHECK_S`: an
idle reader burns no CPU and a lost wake-up costs one re-check. (Naps rather than a longer spin:
on two cores a writer and two readers share the CPUs, and a spinning waiter takes them from the
process it waits for.) A reader parks only after waiting `PARK_AFTER_S` since the previous message
was published, so the writer sends a wake-up only when the previous publish is at least half that
old: hot traffic costs no socket work. A writer that finds no free chunk spins for `YIELD_S`,
then sleeps in growing steps, and logs a warning every `TREADLE_RINGBUFFER_WARNING_INTERVAL`
seconds (60) naming the readers that hold it up. Both sides take timeouts, and `shutdown()`
wakes whatever waits on this object.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import zmq

from treadle import envs
from treadle.ipc.shm_ring import memory_fence
from treadle.logger import init_logger

if TYPE_CHECKING:
    from treadle.ipc.shm_broadcast import Handle
    from treadle.ipc.shm_ring import ShmRingBuffer

logger = init_logger("treadle.ipc.shm_broadcast")  # (its lines are the queue's)

YIELD_S = 100e-6
"""A waiter spins with `sched_yield` this long: the hot path of small messages."""
NAP_S = 50e-6
"""Then a reader sleeps in steps this short, leaving the CPU to the writer it waits for."""
PARK_AFTER_S = 0.002
"""A reader parks after waiting this long (a protocol constant: the writer's wake-ups rely on it)."""
RECHECK_S = 1.0
"""A parked reader re-checks the flags at least this often."""
_WRITER_SLEEP_S = (20e-6, 500e-6)  # a writer facing a full ring sleeps from .. to, doubling


class MessageQueueShutdown(RuntimeError):
    """Raised by a wait on a queue whose `shutdown()` was called."""


def _warning_interval() -> float:
    return envs.ringbuffer_warning_interval()


class RingWaits:
    """The waits of a `MessageQueue` (its base: it holds the ring, sockets and state)."""

    buffer: ShmRingBuffer | None
    handle: Handle
    current_idx: int
    n_local_reader: int
    local_reader_rank: int
    notify_socket: zmq.Socket[Any] | None
    _all_read: bytes
    _no_reads: bytes
    _last_publish: float
    _shutting_down: bool
    _wake_r: int

    def _acquire_write(self, timeout: float | None) -> int:
        """Wait until the next chunk is free (never written, or read by all) and claim it."""
        assert self.buffer is not None
        idx = self.current_idx
        meta = self.buffer.metadata
        base = idx * self.buffer.metadata_size
        flags = slice(base + 1, base + 1 + self.n_local_reader)
        if meta[base] and meta[flags] != self._all_read:
            start = time.monotonic()
            deadline = None if timeout is None else start + timeout
            interval = _warning_interval()
            next_warning = start + interval
            sleep_s = 0.0
            while meta[base] and meta[flags] != self._all_read:
                self._check_shutdown()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimeoutError(
                        f"MessageQueue.enqueue: no free chunk in {timeout} s; "
                        f"{self._laggards(meta[flags])}"
                    )
                if now >= next_warning:
                    logger.warning(
                        "No free chunk in the shared-memory MessageQueue for %.0f s: %s",
                        now - start,
                        self._laggards(meta[flags]),
                    )
                    next_warning = now + interval
                if now - start < YIELD_S:
                    os.sched_yield()
                else:
                    sleep_s = min(max(2 * sleep_s, _WRITER_SLEEP_S[0]), _WRITER_SLEEP_S[1])
                    time.sleep(sleep_s)
        meta[base] = 0
        memory_fence()
        return idx

    def _laggards(self, flags: memoryview) -> str:
        ranks = self.handle.local_reader_ranks
        behind = [ranks[i] for i, f in enumerate(flags) if not f]
        return (
            f"reader rank(s) {behind} have not read chunk {self.current_idx} "
            "(blocked, busy elsewhere, or dead?)"
        )

    def _publish(self, idx: int) -> None:
        """Mark chunk `idx` written; wake the readers unless none can be parked.

        A reader parks only `PARK_AFTER_S` after it started waiting, which is after it saw the
        previous message, which is after `_last_publish` (read before that publish). So if this
        publish follows the previous one by less than that, no reader had parked before it,
        and a reader about to park sees it in its last check before parking.
        """
        assert self.buffer is not None
        meta = self.buffer.metadata
        base = idx * self.buffer.metadata_size
        started = time.monotonic()
        memory_fence()
        meta[base + 1 : base + 1 + self.n_local_reader] = self._no_reads
        memory_fence()
        meta[base] = 1
        memory_fence()
        self.current_idx = (idx + 1) % self.buffer.max_chunks
        if time.monotonic() - self._last_publish >= PARK_AFTER_S / 2:  # half: a safety margin
            assert self.notify_socket is not None
            self.notify_socket.send(b"", zmq.NOBLOCK)
        self._last_publish = started

    def _acquire_read(self, timeout: float | None) -> int:
        """Wait (spin, nap, park) until the next chunk is written and unread by this reader."""
        assert self.buffer is not None
        idx = self.current_idx
        meta = self.buffer.metadata
        base = idx * self.buffer.metadata_size
        mine = base + 1 + self.local_reader_rank
        if meta[base] and not meta[mine]:
            memory_fence()
            return idx
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        while not (meta[base] and not meta[mine]):
            self._check_shutdown()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"MessageQueue.dequeue: nothing arrived in {timeout} s")
            if now - start < PARK_AFTER_S:
                if now - start < YIELD_S:
                    os.sched_yield()
                else:
                    time.sleep(NAP_S)
                continue
            # Park: drop stale wake-ups, re-check, then sleep until a wake-up, shutdown, the
            # deadline or the re-check interval. A wake-up sent after the drain stays queued.
            self._drain_notify()
            memory_fence()
            if meta[base] and not meta[mine]:
                break
            wait = RECHECK_S if deadline is None else min(RECHECK_S, deadline - now)
            self._poll(self.notify_socket, now + wait)
        memory_fence()
        return idx

    def _drain_notify(self) -> None:
        assert self.notify_socket is not None
        try:
            while True:
                self.notify_socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _check_shutdown(self) -> None:
        if self._shutting_down:
            raise MessageQueueShutdown("the MessageQueue was shut down")

    def _poll(self, sock: zmq.Socket[Any] | None, deadline: float | None) -> bool:
        """Wait until `sock` is readable (True) or `deadline` passes (False); raises
        `MessageQueueShutdown` if `shutdown()` is called meanwhile."""
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            self._check_shutdown()
            if deadline is None:
                wait_ms = int(RECHECK_S * 1000)
            else:
                wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(poller.poll(wait_ms))
            self._check_shutdown()
            if sock in events:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
