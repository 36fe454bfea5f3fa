"""The supervisor's sockets while serving (issue 25): its word to the API servers (`Notes`,
one thread: the engines' start-up phases, then the engine events it publishes), and what it
reads in one thread (`SupervisorDesk`):

- every API server's engine events (`frontend/engine_events.py`): an engine's death report,
  which the supervisor's `EngineDied` and restart line quote (`report_of`); a stalled engine
  to kill (`StallKill`); a remote engine found silent (`EngineLost`, published to every API
  server); a question of a starting API server (`Ask`, answered with `Known`);
- where some engines run on other hosts (`--headless`), the handshake socket, kept open
  after start-up (`EngineLauncher.handshake(keep=True)`), for two kinds of engine core that
  start later:
  - this host's, restarted by the supervisor (`handshake`): answered as at start-up, and the
    restart waits for its READY (or its start-up error);
  - another host's, started again for its rank after its engine went away: answered with a
    new launch of that rank (the API servers take it back when it connects to them:
    `EngineWatch.on_new_launch`) once that rank is lost (an API server found it silent).
    Until then its HELLO is held, for at most the time an API server takes to lose an engine
    that went away (`HOLD_S`); past that, an engine of that rank still answers and the new
    one is refused (it fails its start-up saying why). This host's own ranks never rejoin
    this way.
  - another host's, for a rank that `POST /scale` adds (`join`, `cli/supervised_scale.py`):
    answered once the scale admits that rank, whether its HELLO came first (held:
    `HandshakeDesk.hold`) or within TREADLE_SCALE_JOIN_TIMEOUT_S after.

With one API server, that server answers its handshake socket itself (`engine_rejoin.py`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from treadle import envs
from treadle.config import EngineConfig
from treadle.frontend.engine_events import (
    Ask,
    EngineEvent,
    EngineLost,
    EngineRaised,
    Known,
    ScaleAck,
    ScaleAsk,
    StallKill,
    decode,
    encode,
)
from treadle.frontend.engine_rejoin import failed_join, join_timeout
from treadle.frontend.engine_watch import ENGINE_PING_TIMEOUT_S
from treadle.frontend.handshake import HandshakeDesk, Hello
from treadle.frontend.startup import StartupProgress, startup_address
from treadle.ipc.inbound import DropLog
from treadle.ipc.process import ChildProcess
from treadle.ipc.zmq_utils import get_open_zmq_ipc_path, make_zmq_socket
from treadle.logger import init_logger
from treadle.wire.control import DeathReport, Handshake, StartupPhases

logger = init_logger(__name__)

HOLD_S = ENGINE_PING_TIMEOUT_S + 5.0
"""How long a HELLO for a remote rank that is not lost waits for it to be."""


class SupervisorDesk:
    def __init__(
        self,
        reports: zmq.Socket[Any],
        desk: HandshakeDesk | None,
        local_ranks: Callable[[], range],
        publish: Callable[[EngineEvent], None],
        kill: Callable[[StallKill], None],
        scale: Callable[[ScaleAsk | ScaleAck], None] = lambda event: None,
    ) -> None:
        self.reports = reports
        self.desk = desk
        self.local_ranks = local_ranks
        self.publish = publish
        self.kill = kill
        self.scale = scale  # `POST /scale` (`supervised_scale.py`)
        self.stop = threading.Event()
        self._changed = threading.Condition()  # guards everything below, and `desk`
        self._deaths: dict[int, DeathReport] = {}  # rank -> its report, until asked for
        self.lost: dict[int, EngineLost] = {}  # rank -> why it is lost (until it rejoins)
        self._held: dict[int, tuple[Hello, float]] = {}  # rank -> its HELLO, and when it came
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
        """The engine's own death report, if an API server handed it on within `wait_s`."""
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

    def join(self, rank: int, config: EngineConfig, stop: threading.Event) -> Handshake:
        """`POST /scale` adds `rank`, another host's: its HELLO is answered (held already, or
        within TREADLE_SCALE_JOIN_TIMEOUT_S), and its READY awaited (within
        TREADLE_ENGINE_READY_TIMEOUT_S); returns the READY. Raises `TimeoutError` saying what
        to start where."""
        desk = self.desk
        assert desk is not None
        with self._changed:
            desk.expect([rank])
        deadline, loading = time.monotonic() + envs.scale_join_timeout_s(), False
        while True:
            with self._changed:
                if self._changed.wait_for(lambda: rank in desk.ready, timeout=0.1):
                    return desk.ready[rank]
                if rank in desk.failed:
                    raise RuntimeError(failed_join(rank, desk.failed[rank]))
                if not loading and desk.joining(rank):  # greeted: it loads now
                    deadline, loading = time.monotonic() + envs.engine_ready_timeout_s(), True
            if self.stop.is_set() or stop.is_set():
                raise RuntimeError(f"the server stopped while rank {rank} joined")
            if time.monotonic() > deadline:
                raise TimeoutError(join_timeout(rank, loading, config))

    def forget(self, ranks: range) -> None:
        """These ranks were removed, or their scale out failed."""
        with self._changed:
            if self.desk is not None:
                self.desk.forget(ranks)
            for rank in ranks:
                self.lost.pop(rank, None)
                self._held.pop(rank, None)

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
                        elif isinstance(got, int):  # (its READY: a lost one rejoins)
                            self.lost.pop(got, None)
                    self._decide_held()
                    for reply in self.desk.take():
                        self.desk.sock.send_multipart(reply)
                self._changed.notify_all()

    def lose(self, event: EngineLost) -> None:
        """Engine `event.rank` is lost (its restart failed here, or an API server found it
        silent): every API server is told, once; a lost one stays as it is."""
        with self._changed:
            if event.rank in self.lost:
                return
            self.lost[event.rank] = event
        logger.error("%s", event.cause)
        self.publish(event)

    def _on_report(self, frames: list[bytes]) -> None:
        """(Holding `_changed`.)"""
        try:
            if len(frames) != 1:
                raise ValueError(f"{len(frames)} frames")
            event = decode(frames[0])
        except Exception as e:  # (bounded and checked: an API server is ours)
            self._drops.drop("Dropped a malformed event of an API server: %s", e)
            return
        if isinstance(event, EngineRaised):
            self._deaths[event.report.engine_index] = event.report
        elif isinstance(event, StallKill):
            self.kill(event)
        elif isinstance(event, EngineLost) and event.rank not in self.lost:
            logger.warning("%s (an API server found it)", event.cause)
            self.lost[event.rank] = event
            self.publish(event)
        elif isinstance(event, Ask):
            self.publish(Known(list(self.lost.values())))
        elif isinstance(event, ScaleAsk | ScaleAck):
            self.scale(event)

    def _on_hello(self, hello: Hello) -> None:
        """A HELLO the desk did not expect: a remote engine that rejoins its rank, or not."""
        assert self.desk is not None
        rank = hello.rank
        if rank >= len(self.desk.launches):  # not ours (yet): `POST /scale` may add it
            self.desk.hold(hello)
        elif rank in self.local_ranks():
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
        self.desk.decide_early()
        now = time.monotonic()
        for rank, (hello, since) in list(self._held.items()):
            if self.desk.admits(rank):  # (it came as `POST /scale` admitted its rank)
                del self._held[rank]
                self.desk.greet(hello)
            elif rank in self.lost:  # (dropped when the engine that joined last said READY)
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


class Notes:
    """The supervisor's word to its API servers (issue 25), on PUB sockets from one thread:
    while the engines start, their phases (`StartupPhases`, to each API server's
    `startup_address`, bound while its engine client is built) at each change and every half
    second; then each engine event once, as it comes (`publish`, from any thread:
    `engine_events.py`). Each API server binds its SUB on an ipc address of its own
    (`addresses`, by client index; a restarted one binds the same) and the PUB connects to
    every one: an API server removes its file as it exits, also when this process was killed
    (its death pipe), and this process removes those of killed API servers."""

    def __init__(self, count: int) -> None:
        self.addresses = [get_open_zmq_ipc_path() for _ in range(count)]
        self._thread: threading.Thread | None = None
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def publish(self, event: EngineEvent) -> None:
        self._outbox.put(encode(event))

    def start(self, progress: StartupProgress, stop: threading.Event) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(progress, stop), name="supervisor-notes", daemon=True
        )
        self._thread.start()

    def _run(self, progress: StartupProgress, stop: threading.Event) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        sock = make_zmq_socket(ctx, self.addresses[0], zmq.PUB, bind=False, linger=0)
        starting = make_zmq_socket(
            ctx, startup_address(self.addresses[0]), zmq.PUB, bind=False, linger=0
        )
        for address in self.addresses[1:]:
            sock.connect(address)
            starting.connect(startup_address(address))
        try:
            while not stop.is_set():
                if not starting.closed:  # at each change, and every half second
                    progress.changed.wait(0.5)
                    progress.changed.clear()
                    starting.send(msgspec.msgpack.encode(StartupPhases(list(progress.phases))))
                    if progress.done:  # (the last one says every engine is ready)
                        starting.close(linger=0)
                    continue
                with contextlib.suppress(queue.Empty):
                    sock.send(self._outbox.get(timeout=0.2))
        finally:
            starting.close(linger=0)
            sock.close(linger=0)
            ctx.term()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(2.0)
