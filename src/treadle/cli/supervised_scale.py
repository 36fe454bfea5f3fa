"""`POST /scale` with several API servers (issue 42 item 3): the supervisor's side. It owns
the engines' processes, the handshake and the DP coordinator, so it runs the scale that an
API server asks for (`ScaleAsk`) in its main thread (between restarts, never beside one),
and every API server applies each step and acknowledges it (`frontend/scale_follow.py`
draws the steps).

With engines on other hosts (`-dpl` < `-dp`) this host keeps its `-dpl` engines: a new rank
is another host's (`treadle serve --headless -dpr R`), whose HELLO the handshake socket kept
open answers once the rank is admitted (`SupervisorDesk.join`: held if it came first, else
awaited for TREADLE_SCALE_JOIN_TIMEOUT_S); a leaving one is asked to stop by the API servers
(the `release` step) once drained, and exits 0 on its host.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import zmq

from treadle.cli.supervised_desk import SupervisorDesk
from treadle.cli.supervisor_stop import Stop
from treadle.frontend.engine_events import (
    EngineEvent,
    ScaleAck,
    ScaleAsk,
    Scaled,
    ScaleEnded,
    ScaleStep,
)
from treadle.frontend.engine_scale import (
    MAX_DATA_PARALLEL_SIZE,
    NO_COORDINATOR,
    RELEASE_S,
    check_local,
)
from treadle.frontend.engine_watch import ENGINE_PING_TIMEOUT_S
from treadle.frontend.launcher import EngineLauncher
from treadle.frontend.scale_follow import ScaleRefused
from treadle.ipc.process import (
    ChildProcess,
    ProcessMonitor,
    shutdown_processes,
    signal_children,
    stop_watched,
)
from treadle.logger import init_logger

logger = init_logger(__name__)

ACK_S = 30.0
"""How long a step waits for every API server's acknowledgement (beyond its own drain)."""


def split_addresses(reports: list[list[str]]) -> tuple[list[str], list[str], list[bytes]]:
    """What the API servers reported on their ready pipes (`AttachTo`): each one's ROUTER and
    PULL addresses and engine key -> the handshake's inputs, outputs and keys."""
    return (
        [r[0] for r in reports],
        [r[1] for r in reports],
        [bytes.fromhex(r[2]) for r in reports],
    )


class _Refused(Exception):
    """Said to the asking API server as a 400 (`busy`: 409)."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


class SupervisorScale:
    def __init__(
        self,
        launcher: EngineLauncher,
        stop: Stop,
        publish: Callable[[EngineEvent], None],
        api_servers: list[ChildProcess],
        addresses: Callable[[], list[list[str]]],
        forget: Callable[[int], None],
    ) -> None:
        self.launcher = launcher
        self.stop = stop
        self.publish = publish
        self.api_servers = api_servers
        self.addresses = addresses
        self.forget = forget  # a removed rank's lost record and stall kill
        self.monitor: ProcessMonitor | None = None
        self.desk: SupervisorDesk | None = None  # its handshake socket: engines of other hosts
        self._busy = False
        self._acks: dict[tuple[str, int], set[int]] = {}
        self._changed = threading.Condition()

    # -- the desk's thread ----------------------------------------------------------------

    def on_event(self, event: ScaleAsk | ScaleAck) -> None:
        if isinstance(event, ScaleAck):
            with self._changed:
                self._acks.setdefault((event.step, event.size), set()).add(event.client_index)
                self._changed.notify_all()
            return
        with self._changed:
            busy, self._busy = self._busy, True
        if busy:
            why = "a scale is already under way: try again when it ends"
            self.publish(ScaleEnded(event.client_index, 0, event.size, why, busy=True))
            return
        self.stop.jobs.put(lambda: self.run(event))

    # -- the main thread ------------------------------------------------------------------

    def run(self, ask: ScaleAsk) -> None:
        launcher = self.launcher
        old = launcher.num_engines
        try:
            self._check(ask.size)
            if ask.size > old:
                self._out(old, ask.size)
            elif ask.size < old:
                self._in(old, ask.size, ask.drain_timeout)
            ended = ScaleEnded(ask.client_index, old, ask.size)
        except _Refused as e:
            ended = ScaleEnded(ask.client_index, old, ask.size, f"refused: {e}", e.busy)
        except Exception as e:
            logger.error("Scaling to %d engines failed: %s", ask.size, e)
            ended = ScaleEnded(ask.client_index, old, ask.size, str(e)[:4000])
        finally:
            with self._changed:
                self._busy = False
                self._acks.clear()
        self.publish(ended)

    def _check(self, n: int) -> None:
        launcher = self.launcher
        if not 1 <= n <= MAX_DATA_PARALLEL_SIZE:
            raise _Refused(f"data_parallel_size must be 1 to {MAX_DATA_PARALLEL_SIZE}, not {n}")
        p = launcher.config.parallel
        try:
            check_local(n, p.local_engine_count, p.multi_node)
        except ScaleRefused as e:
            raise _Refused(str(e)) from None
        if launcher.coordinator is None:
            raise _Refused(NO_COORDINATOR)
        if self.stop.event.is_set():
            raise _Refused("the server is stopping")

    def _step(self, event: EngineEvent, step: str, size: int, timeout: float) -> None:
        """Publish `event`; return once every API server acknowledged `step` to `size`."""
        self.publish(event)
        everyone = set(range(len(self.api_servers)))
        deadline = time.monotonic() + timeout
        with self._changed:
            while not everyone <= self._acks.get((step, size), set()):
                left = deadline - time.monotonic()
                if left <= 0 or self.stop.event.is_set():
                    missing = sorted(everyone - self._acks.get((step, size), set()))
                    raise TimeoutError(f"API server(s) {missing} did not apply the {step} step")
                self._changed.wait(min(left, 0.2))

    def _out(self, old: int, n: int) -> None:
        launcher, monitor = self.launcher, self.monitor
        assert monitor is not None
        where = (
            "waiting for the --headless engine(s) of"
            if launcher.config.parallel.multi_node
            else "starting"
        )
        logger.info(
            "Scaling out from %d to %d engines: %s EngineCore_DP%d..%d", old, n, where, old, n - 1
        )
        start = time.monotonic()
        self._step(ScaleStep("admit", n), "admit", n, ACK_S)
        if launcher.progress is not None:
            launcher.progress.resize(n)
        children = launcher.add_engines(n)
        ctx: zmq.Context[Any] = zmq.Context()
        pids = [child.pid or 0 for child in children]
        theirs = range(old + len(children), n)  # (another host's: nothing starts here)
        try:
            if children:
                ours = range(old, old + len(children))
                launcher.handshake(ctx, *split_addresses(self.addresses()), ranks=ours)
            for rank in theirs:
                assert self.desk is not None
                pids.append(self.desk.join(rank, launcher.config, self.stop.event).pid)
                logger.info("Scaling out: EngineCore_DP%d of another host is ready", rank)
        except BaseException as e:
            logger.error("Scaling out to %d engines failed: %s; stopping the new ones", n, e)
            self.stop.retired.extend(children)
            for child in children:
                child.process.kill()
            shutdown_processes(children, timeout=1.0)
            if self.desk is not None:
                self.desk.forget(range(old, n))
            launcher.remove_engines(old)
            if launcher.progress is not None:
                launcher.progress.resize(old)
            self._step(Scaled(old, old), "scaled", old, ACK_S)
            raise
        finally:
            ctx.term()
        for child in children:
            monitor.add(child)
        self._new_coordinator()
        self._step(Scaled(old, n, pids), "scaled", n, ENGINE_PING_TIMEOUT_S + ACK_S)
        logger.info("Scaled out from %d to %d engines in %.1f s", old, n, time.monotonic() - start)

    def _in(self, old: int, n: int, drain_timeout: float) -> None:
        launcher = self.launcher
        logger.info(
            "Scaling in from %d to %d engines: draining EngineCore_DP%d..%d", old, n, n, old - 1
        )
        self._step(ScaleStep("drain", n, drain_timeout), "drain", n, drain_timeout + ACK_S)
        if any(rank not in launcher.local_ranks for rank in range(n, old)):  # other hosts'
            self._step(ScaleStep("release", n), "release", n, RELEASE_S + ACK_S)
        if self.desk is not None:
            self.desk.forget(range(n, old))
        children = launcher.remove_engines(n)
        self.stop.retired.extend(children)
        # (By its sentinel: `is_alive` would reap it, which is the process monitor's job.)
        running = [child for child in children if not wait([child.sentinel], 0)]
        signal_children(running, signal.SIGUSR1)
        stop_watched(children, 30.0)
        for child in running:
            logger.info("Scaling in: %s stopped", child.describe())
        for rank in range(n, old):
            self.forget(rank)
        if launcher.progress is not None:
            launcher.progress.resize(n)
        self._new_coordinator()
        self._step(Scaled(old, n), "scaled", n, ACK_S)
        logger.info("Scaled in from %d to %d engines", old, n)

    def _new_coordinator(self) -> None:
        launcher, monitor = self.launcher, self.monitor
        assert launcher.coordinator is not None and monitor is not None
        self.stop.retired.append(launcher.coordinator)
        monitor.add(launcher.resize_coordinator())
        logger.info("The DP coordinator now counts %d engines", launcher.num_engines)
