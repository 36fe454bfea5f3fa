"""Every way the API server's engine client learns that an engine died, left, stalled or came
back, in one place. A detector here only reports (`died`, `down`, `back`, `lost`, `stall`,
or the client's end) to the state machine of `engine_restarts.py`, whose table says what
each report does.

Detectors: the process sentinel (`ProcessMonitor`, engines this client started), the
`ENGINE_CORE_DEAD` and `ENGINE_CORE_STOPPED` frames, the supervisor's events (its engines:
`engine_events.py`), a restarted engine's hello (its first message on the ROUTER), a peer
leaving a socket and the ping that follows it (engines that no process watch here covers),
the stall watch, and a background task that raises (`GuardedTasks`). With a supervisor, what
only an API server sees (a death report, a stall to kill, a silent remote engine) goes to
the supervisor as an event (`publish`), and comes back to every API server as one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import psutil
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from treadle import envs
from treadle.frontend.core_client import EngineDeadError
from treadle.frontend.engine_events import (
    REPORT_WAIT_S,
    Ask,
    EngineEvent,
    EngineLost,
    EngineRaised,
    EventCounts,
    Known,
    apply,
    decode,
)
from treadle.frontend.engine_restarts import EngineRestarts
from treadle.frontend.engine_state import Death, EngineState, RestartMode, death_cause
from treadle.frontend.inflight import InFlight
from treadle.frontend.launcher import EngineLauncher
from treadle.ipc.inbound import DropLog
from treadle.ipc.process import ChildProcess, describe_exit
from treadle.logger import init_logger
from treadle.wire.control import ENGINE_CORE_STOPPED, DeathReport

logger = init_logger(__name__)

# How long an engine may take to answer when a peer left the request socket (a step of a long
# prefill must fit), or to say hello after a restart: one that does not is dead.
ENGINE_PING_TIMEOUT_S = 10.0
# An engine process's exit explains a disconnect seen this long after it.
_EXIT_EXPLAINS_S = 5.0
# How long a disconnect waits for the exit that explains it (a process's sockets close just
# before its exit shows).
_EXIT_LOOK_S = 0.5


class Watched(Protocol):
    """What the detectors read of the client, and the two ends they may report."""

    launcher: EngineLauncher | None
    inflight: InFlight

    @property
    def ended(self) -> bool: ...

    def fail(self, reason: str) -> None:
        """The client ends: every request fails, the server exits non-zero."""

    def stop(self, reason: str) -> None:
        """The client ends because an engine was stopped on purpose."""

    async def call_utility(self, method: str, *args: Any, engine: int = 0) -> Any: ...


class GuardedTasks:
    """The client's background tasks: kept in a set (the event loop holds a task only
    weakly), and guarded: one that raises is logged with its traceback and, when `fatal`,
    ends the client (`fail`), so that nothing is left waiting on a reader that is gone."""

    def __init__(self, fail: Callable[[str], None], closed: Callable[[], bool]) -> None:
        self._fail = fail
        self._closed = closed
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None], what: str, fatal: bool = True) -> None:
        task = asyncio.get_running_loop().create_task(self._guard(coro, what, fatal))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, coro: Coroutine[Any, Any, None], what: str, fatal: bool) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if self._closed():
                return
            logger.exception("The %s failed", what)
            if fatal:
                self._fail(f"the front end's {what} failed: {type(e).__name__}: {e}")

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class EngineWatch:
    """The detectors of one client. `mode` says who restarts its engines; `local_ranks` are
    the engines of this host (with the supervisor's: watched by pid); `unwatched` those whose
    death only a disconnect and a silence show (another host's, or the supervisor's when it
    does not restart them)."""

    def __init__(
        self,
        client: Watched,
        restarts: EngineRestarts,
        mode: RestartMode,
        local_ranks: range,
        num_engines: int,
        started_here: bool,
    ) -> None:
        self.client = client
        self.restarts = restarts
        self.mode = mode
        self.local_ranks = local_ranks
        # This host's engines are watched as processes: by the sentinel (ours), or by pid.
        watched = local_ranks if started_here or mode is RestartMode.FOLLOW else ()
        self.unwatched = [rank for rank in range(num_engines) if rank not in watched]
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tasks: GuardedTasks | None = None
        self._awaiting_hello: dict[int, asyncio.Future[None]] = {}  # rank -> its restart's
        # (when, what, on purpose) of this host's engine processes that exited, and of
        # engines that left on purpose: explains a disconnect (a warning unless on purpose)
        self._exits: collections.deque[tuple[float, str, bool]] = collections.deque(maxlen=16)
        self.expected_stops = 0  # engines stopped on purpose by `POST /scale`: not our stop
        # An API server of a supervisor tells it what it saw (`engine_events.py`).
        self.publish: Callable[[EngineEvent], None] | None = None
        self.counts = EventCounts()  # the supervisor's events applied here
        self.known = asyncio.Event()  # the supervisor answered our `Ask`

    def start(self, tasks: GuardedTasks, sockets: list[tuple[zmq.Socket[Any], str]]) -> None:
        """Run the watches (in the running loop); `sockets`: (monitor socket, what it
        watches) of each socket whose peers may leave."""
        self.loop, self.tasks = asyncio.get_running_loop(), tasks
        tasks.spawn(self.watch_stalls(), "engine stall watch")
        for monitor, name in sockets:
            tasks.spawn(self.watch_peers(monitor, name), f"{name} socket watch")

    # -- the process sentinel (the process monitor's thread) ------------------------------

    def on_child_death(self, child: ChildProcess) -> bool:
        """One of our processes ended: a dead engine core or DP coordinator is restarted
        (OWN); returns whether it is (else the client ends: `MPClient._on_child_death`)."""
        self.note_exit(child)
        launcher, loop = self.client.launcher, self.loop
        if child.exitcode == 0 or self.mode is not RestartMode.OWN:
            return False
        if launcher is None or loop is None or self.tasks is None:  # (before the loop runs)
            return False
        cause = death_cause(child.name, child.exitcode)
        if child is launcher.coordinator:
            return _in_loop(loop, self._guarded, self.restarts.coordinator_died, cause)
        for i, engine in enumerate(launcher.engines):
            if engine is child:
                rank = launcher.start_rank + i
                return _in_loop(loop, self._report_death, rank, cause, child.exitcode)
        return False

    def _report_death(self, rank: int, cause: str, exitcode: int | None) -> None:
        """(In the loop.)"""
        assert self.tasks is not None
        self.tasks.spawn(self._died(rank, cause, exitcode), "engine death report")

    def note_exit(self, child: ChildProcess, on_purpose: bool = False) -> None:
        """A process of this host exited: it explains a peer that leaves a socket;
        `on_purpose`: it was stopped on purpose (`POST /scale` retired it)."""
        what = f"{child.describe()} exited: {describe_exit(child.exitcode)}"
        self.note_gone(what, on_purpose)

    def note_gone(self, what: str, on_purpose: bool = False) -> None:
        """`what` explains a peer that leaves a socket now (e.g. an engine of another host
        that `POST /scale` released: `on_purpose`, logged as information, not a warning)."""
        self._exits.append((time.monotonic(), what, on_purpose))

    async def _died(self, rank: int, cause: str, exitcode: int | None) -> None:
        """Report the death with the engine's own report: an engine core that raised sent it
        before its exit 1, and it may still wait in the output socket for a moment."""
        deadline = time.monotonic() + REPORT_WAIT_S
        slot = self.restarts.slots[rank]
        while exitcode == 1 and slot.report is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.restarts.died(rank, Death(cause, self.restarts.take_report(rank)))

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """A report the process monitor scheduled; one that raises ends the client (an
        engine must not stay `restarting` with nobody restarting it)."""
        try:
            fn(*args)
        except Exception as e:
            logger.exception("Handling a child's death failed")
            self.client.fail(f"handling a child's death failed: {type(e).__name__}: {e}")

    # -- frames on the output socket ------------------------------------------------------

    def on_control_frame(self, frame: bytes | DeathReport) -> bool:
        """`ENGINE_CORE_DEAD` (a `DeathReport`, or the bare frame): the engine exits next,
        and its exit is what restarts it, reported with this report (the client ends when
        nobody restarts it: returns False, nothing more to read). `ENGINE_CORE_STOPPED`: it
        answered every request and stopped on purpose, so the client stops (other engines
        may still finish theirs: True)."""
        if frame == ENGINE_CORE_STOPPED:
            if self.expected_stops > 0:  # one that `POST /scale` removes
                self.expected_stops -= 1
                return True
            self.client.stop("an engine core was stopped")
            return True
        what = "an engine core reported a fatal error (see its log)"
        if isinstance(frame, DeathReport):
            rank = frame.engine_index
            what = f"EngineCore_DP{rank} failed: {frame.describe()}"
            if 0 <= rank < len(self.restarts.slots):
                self.restarts.note_report(rank, frame, final=self.mode is RestartMode.OFF)
            if self.publish is not None:
                self.publish(EngineRaised(frame))
        if self.mode is RestartMode.OFF:
            self.client.fail(what)
            return False
        logger.warning("%s; its exit follows", what[:1].upper() + what[1:])
        return True

    # -- hellos on the request socket -----------------------------------------------------

    def expect_hello(self, rank: int) -> asyncio.Future[None]:
        """The restart of `rank` (OWN) waits for its new process's hello on this future
        (`forget_hello` when done)."""
        assert self.loop is not None
        hello: asyncio.Future[None] = self.loop.create_future()
        self._awaiting_hello[rank] = hello
        return hello

    def forget_hello(self, rank: int) -> None:
        self._awaiting_hello.pop(rank, None)

    async def on_new_launch(self, rank: int, pid: int) -> None:
        """A new launch of engine `rank` said hello: ours (a restart waits for it), one of
        another host that rejoins its lost rank (`engine_rejoin.py` took its handshake), or
        the supervisor's, which replaced a process that died (its `EngineDied` applied, or not
        yet)."""
        if rank < len(self.restarts.slots):  # (not one that `POST /scale` adds: no slot yet)
            self.restarts.new_launch(rank, pid)
        awaited = self._awaiting_hello.get(rank)
        if awaited is not None and not awaited.done():
            awaited.set_result(None)
        elif self.restarts.slots[rank].state is EngineState.LOST:
            await self.restarts.rejoined(rank)
        elif self.mode is RestartMode.FOLLOW:
            if self.restarts.slots[rank].state is not EngineState.RESTARTING:
                self.restarts.down(rank, f"EngineCore_DP{rank} was restarted (it died)")
            await self.restarts.back(rank, "(restarted by the supervisor)")

    # -- the supervisor's events (several API servers) ----------------------------------

    async def watch_supervisor(self, sock: zmq.Socket[Any]) -> None:
        """Apply each event the supervisor publishes (`engine_events.apply`)."""
        drops = DropLog(logger)
        reader = zmq.asyncio.Socket.from_socket(sock)
        while True:
            payload = await reader.recv()
            try:
                event = decode(payload)
            except Exception as e:  # (the supervisor is ours: a bug, or a stranger)
                drops.drop("Dropped a malformed message of the supervisor: %s", e)
                continue
            await apply(event, self.restarts, self.counts)
            if isinstance(event, Known):
                self.known.set()

    async def ask(self, client_index: int) -> None:
        """Once at the start: what the supervisor knows (the engines lost before this API
        server started: a restarted one). Asked again until answered (its first answer may
        come before its PUB connects to us)."""
        assert self.publish is not None
        while not self.known.is_set():
            self.publish(Ask(client_index))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.known.wait(), 1.0)

    # -- the stall watch ------------------------------------------------------------------

    async def watch_stalls(self) -> None:
        """Each quarter second, how long each busy engine has gone without finishing a step."""
        restarts = self.restarts
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for slot in list(restarts.slots):
                busy = slot.state.serves and self.client.inflight.count(slot.rank) > 0
                restarts.stall(slot.rank, now - slot.last_progress if busy else None)

    # -- peers leaving a socket, and the ping that follows --------------------------------

    async def watch_peers(self, monitor: zmq.Socket[Any], name: str) -> None:
        """Log each peer that leaves the socket `name`, with what explains it (an engine
        process that exited, and how; an engine that does not answer), or else the hint
        that libzmq drops a peer that sends more than TREADLE_ZMQ_MAX_MSG_BYTES. A peer
        leaving the request socket may be an `unwatched` engine whose process or host is
        gone: each such engine must then answer a call within ENGINE_PING_TIMEOUT_S (a bare
        disconnect would let any local process that connects and leaves kill the server). A
        silent one is lost, and the others serve on, when restarts are on and some are left;
        otherwise the client ends."""
        sock = zmq.asyncio.Socket.from_socket(monitor)
        while True:
            event = parse_monitor_message(await sock.recv_multipart())
            if event["event"] != zmq.EVENT_DISCONNECTED or self.client.ended:
                continue
            silent: list[int] = []
            if name == "request" and self.unwatched:
                silent = await self._silent_engines()
                states = self.restarts.states
                left = sum(state is not EngineState.LOST for state in states) - len(silent)
                if silent and (left == 0 or self.mode is RestartMode.OFF):
                    self.client.fail(f"engine core(s) {silent} disconnected and do not answer")
                    return
                if silent and self.publish is not None:  # the supervisor tells every API server
                    for rank in silent:
                        cause = f"EngineCore_DP{rank} does not answer; it is lost"
                        self.publish(EngineLost(rank, cause, time=time.time()))
                elif silent:  # the others serve on
                    await self.restarts.lost(silent)
            exits, on_purpose = await self._engine_exits()
            if silent:
                exits.append(f"engine core(s) {silent} do not answer (lost)")
            if exits and on_purpose and not silent:
                logger.info("A peer of the %s socket left: %s", name, "; ".join(exits))
            elif exits:
                logger.warning("A peer of the %s socket disconnected: %s", name, "; ".join(exits))
            else:  # nothing else explains it
                logger.warning(
                    "A peer of the %s socket disconnected (it closed, or sent a message "
                    "larger than TREADLE_ZMQ_MAX_MSG_BYTES=%d)",
                    name,
                    envs.zmq_max_msg_bytes(),
                )

    async def _engine_exits(self) -> tuple[list[str], bool]:
        """What explains a peer leaving: engine processes of this host that exited lately
        (ours with their exit codes; a supervisor's by pid) and engines noted gone, looked
        for during a moment; and whether every one of them left on purpose."""
        launcher = self.client.launcher
        deadline = time.monotonic() + _EXIT_LOOK_S
        while True:
            now = time.monotonic()
            recent = [
                (what, meant) for when, what, meant in self._exits if now - when < _EXIT_EXPLAINS_S
            ]
            found = {what for what, _ in recent}
            if launcher is not None:
                for child in launcher.engines:
                    code = child.exitcode  # once: a restart may swap the process meanwhile
                    if code is not None:
                        found.add(f"{child.describe()} exited: {describe_exit(code)}")
            else:
                for rank in self.local_ranks:
                    pid = self.restarts.slots[rank].pid
                    if pid and not running(process_of(pid)):
                        found.add(f"EngineCore_DP{rank} (pid {pid}) exited")
            if found or now > deadline:
                meant = {what for what, on_purpose in recent if on_purpose}
                return sorted(found), bool(found) and found <= meant
            await asyncio.sleep(0.1)

    async def answers(self, engine: int) -> bool:
        """Whether the engine answers a call within ENGINE_PING_TIMEOUT_S."""
        try:
            call = self.client.call_utility("get_stats", engine=engine)
            await asyncio.wait_for(call, ENGINE_PING_TIMEOUT_S)
            return True
        except (TimeoutError, EngineDeadError):
            return False

    async def _silent_engines(self) -> list[int]:
        """The `unwatched` engines that serve and do not answer a call in time (and that no
        other report has lost meanwhile: the supervisor's, after another disconnect)."""
        states = self.restarts.states
        ranks = [e for e in self.unwatched if states[e].serves]
        replies = await asyncio.gather(*(self.answers(e) for e in ranks))
        slots = self.restarts.slots
        return [
            e
            for e, ok in zip(ranks, replies, strict=True)
            if not ok and e < len(slots) and slots[e].state is not EngineState.LOST
        ]


def _in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> bool:
    """Run `fn(*args)` in `loop` (from another thread); False when the loop has closed (the
    server is down: a death seen that late restarts nothing)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed
        return False
    return True


def process_of(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def running(process: psutil.Process | None) -> bool:
    """Whether the process runs (not gone, not a zombie, not a new one on a reused pid)."""
    try:
        return (
            process is not None
            and process.is_running()
            and process.status() != psutil.STATUS_ZOMBIE
        )
    except psutil.Error:
        return False
