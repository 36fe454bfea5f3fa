"""`POST /scale` with several API servers (issue 42 item 3): the supervisor's side. It owns
the engines' processes, the handshake and the DP coordinator, so it runs the scale that an
API server asks for (`ScaleAsk`) in its main thread (between restarts, never beside one),
and every API server applies each step and acknowledges it (`frontend/scale_follow.py`
draws the steps). Engines on other hosts (`--headless`) are refused, saying why.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import zmq

from treadle.cli.supervisor_stop import Stop
from treadle.frontend.engine_events import (
    EngineEvent,
    ScaleAck,
    ScaleAsk,
    Scaled,
    ScaleEnded,
    ScaleStep,
)
from treadle.frontend.engine_scale import MAX_DATA_PARALLEL_SIZE, NO_COORDINATOR, REMOTE_ENGINES
from treadle.frontend.engine_watch import ENGINE_PING_TIMEOUT_S
from treadle.frontend.launcher import EngineLauncher
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
        if launcher.config.parallel.multi_node:
            raise _Refused(REMOTE_ENGINES)
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
        logger.info(
            "Scaling out from %d to %d engines: starting EngineCore_DP%d..%d", old, n, old, n - 1
        )
        start = time.monotonic()
        self._step(ScaleStep("admit", n), "admit", n, ACK_S)
        if launcher.progress is not None:
            launcher.progress.resize(n)
        children = launcher.add_engines(n)
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            launcher.handshake(ctx, *split_addresses(self.addresses()), ranks=range(old, n))
        except BaseException as e:
            logger.error("Scaling out to %d engines failed: %s; stopping the new ones", n, e)
            self.stop.retired.extend(children)
            for child in children:
                child.process.kill()
            shutdown_processes(children, timeout=1.0)
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
        pids = [child.pid or 0 for child in children]
        self._step(Scaled(old, n, pids), "scaled", n, ENGINE_PING_TIMEOUT_S + ACK_S)
        logger.info("Scaled out from %d to %d engines in %.1f s", old, n, time.monotonic() - start)

    def _in(self, old: int, n: int, drain_timeout: float) -> None:
        launcher = self.launcher
        logger.info(
            "Scaling in from %d to %d engines: draining EngineCore_DP%d..%d", old, n, n, old - 1
        )
        self._step(ScaleStep("drain", n, drain_timeout), "drain", n, drain_timeout + ACK_S)
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
