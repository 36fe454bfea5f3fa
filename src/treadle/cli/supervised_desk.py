"""The supervisor's sockets while serving (issue 25), read by one thread:

- API server 0's reports (`frontend/supervisor_reports.py`): its engines' death
  reports, which the supervisor's restart lines quote (`report_of`), and every half second
  the engines lost there (`[LOST_ENGINES, EnginesLost]`);
- where some engines run on other hosts (`--headless`), the handshake socket, kept open
  after start-up (`EngineLauncher.handshake(keep=True)`), for two kinds of engine core that
  start later:
  - this host's, restarted by the supervisor (`handshake`): answered as at start-up, and the
    restart waits for its READY (or its start-up error);
  - another host's, started again for its rank after its engine went away: answered with a
    new launch of that rank (the API servers take it back when it connects to them:
    `EngineWatch.on_new_launch`) once API server 0 has lost that rank. Until then its HELLO
    is held, for at most the time an API server takes to lose an engine that went away
    (`HOLD_S`); past that, an engine of that rank still answers and the new one is refused
    (it fails its start-up saying why). This host's own ranks never rejoin this way.

With one API server, that server answers its handshake socket itself (`engine_rejoin.py`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from treadle import envs
from treadle.frontend.engine_watch import ENGINE_PING_TIMEOUT_S
from treadle.frontend.handshake import HandshakeDesk, Hello
from treadle.ipc.inbound import DropLog
from treadle.ipc.process import ChildProcess
from treadle.logger import init_logger
from treadle.wire.control import LOST_ENGINES, DeathReport, EnginesLost, decode_death_report

logger = init_logger(__name__)
_decode_lost = msgspec.msgpack.Decoder(EnginesLost).decode

HOLD_S = ENGINE_PING_TIMEOUT_S + 5.0
"""How long a HELLO for a remote rank that API server 0 has not lost waits for it to be."""

_LOST_FRESH_S = 2.0
"""API server 0 says which engines it lost every half second: older news is stale."""


class SupervisorDesk:
    def __init__(
        self,
        reports: zmq.Socket[Any],
        desk: HandshakeDesk | None,
        local_ranks: Callable[[], range],
    ) -> None:
        self.reports = reports
        self.desk = desk
        self.local_ranks = local_ranks
        self.stop = threading.Event()
        self._changed = threading.Condition()  # guards everything below, and `desk`
        self._deaths: dict[int, DeathReport] = {}  # rank -> its report, until asked for
        self._lost: dict[int, float] = {}  # rank -> when API server 0 last said it is lost
        self._held: dict[int, tuple[Hello, float]] = {}  # rank -> its HELLO, and when it came
        self._ready_at: dict[int, float] = {}  # remote rank -> when its last engine said READY
        self._drops = DropLog(logger)
        self._thread = threading.Thread(target=self._run, name="supervisor-desk", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (before its sockets are closed)."""
        self.stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)

    # -- what the main thread asks ----------------------------------------------------------

    def report_of(self, rank: int, wait_s: float) -> DeathReport | None:
        """The engine's own death report, if API server 0 handed it on within `wait_s`."""
        with self._changed:
            self._changed.wait_for(lambda: rank in self._deaths, timeout=wait_s)
            return self._deaths.pop(rank, None)

    def handshake(
        self, rank: int, child: ChildProcess, check: Callable[[ChildProcess], None]
    ) -> None:
        """Our new process of `rank` says HELLO and READY; raises its start-up error (`check`)
        if it fails or dies first, `TimeoutError` if it is late."""
        desk = self.desk
        assert desk is not None
        timeout = envs.engine_ready_timeout_s()
        deadline = time.monotonic() + timeout
        with self._changed:
            desk.expect([rank])
        while True:
            with self._changed:
                if self._changed.wait_for(lambda: rank in desk.ready, timeout=0.1):
                    return
            check(child)
            if self.stop.is_set():
                raise RuntimeError("stopped while it started")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"engine core {rank} was not ready within {timeout} s; raise "
                    "TREADLE_ENGINE_READY_TIMEOUT_S if loading the model takes longer"
                )

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.reports, zmq.POLLIN)
        if self.desk is not None:
            poller.register(self.desk.sock, zmq.POLLIN)
        while not self.stop.is_set():
            events = dict(poller.poll(100))
            with self._changed:
                if self.reports in events:
                    self._on_report(self.reports.recv_multipart())
                if self.desk is not None:
                    if self.desk.sock in events:
                        got = self.desk.on_message(self.desk.sock.recv_multipart())
                        if isinstance(got, Hello):
                            self._on_hello(got)
                        elif isinstance(got, int):  # (its READY)
                            self._ready_at[got] = time.monotonic()
                    self._decide_held()
                    for reply in self.desk.take():
                        self.desk.sock.send_multipart(reply)
                self._changed.notify_all()

    def _on_report(self, frames: list[bytes]) -> None:
        try:
            if len(frames) == 2 and frames[0] == LOST_ENGINES:
                now = time.monotonic()
                self._lost.update((rank, now) for rank in _decode_lost(frames[1]).ranks)
            elif len(frames) == 1:
                report = decode_death_report(frames[0])
                self._deaths[report.engine_index] = report
            else:
                raise ValueError(f"{len(frames)} frames")
        except Exception as e:  # (bounded and checked: an API server is ours)
            self._drops.drop("Dropped a malformed report of API server 0: %s", e)

    def _on_hello(self, hello: Hello) -> None:
        """A HELLO the desk did not expect: a remote engine that rejoins its rank, or not."""
        assert self.desk is not None
        rank = hello.rank
        if rank in self.local_ranks():
            self.desk.drops.drop(
                "Dropped a HELLO for engine rank %d on the handshake socket: that engine runs "
                "on this host, and this is not its process",
                rank,
            )
        elif rank in self._held or self.desk.joining(rank):
            self.desk.refuse(hello, f"another engine core is joining as rank {rank}")
        else:
            self._held[rank] = (hello, time.monotonic())

    def _decide_held(self) -> None:
        """Greet each held HELLO whose rank API server 0 has lost; refuse those held too long."""
        assert self.desk is not None
        now = time.monotonic()
        for rank, (hello, since) in list(self._held.items()):
            # Lost: said lately, and of the engine that joined last (not before it connected).
            lost_at = self._lost.get(rank, -_LOST_FRESH_S)
            if now - lost_at < _LOST_FRESH_S and lost_at > self._ready_at.get(rank, 0.0) + 1.0:
                del self._held[rank]
                logger.warning(
                    "An engine core of another host joins as rank %d (lost before): answering "
                    "its handshake",
                    rank,
                )
                self.desk.greet(hello)
            elif now - since > HOLD_S:
                del self._held[rank]
                self.desk.refuse(
                    hello,
                    f"engine rank {rank} is up and answers: stop it first, or give this one "
                    "another --data-parallel-start-rank",
                )
