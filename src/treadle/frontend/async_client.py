"""The API server's engine client: `MPClient` read and written from asyncio tasks, with engine
restarts (`engine_restarts.py`, whose detectors are in `engine_watch.py`) and the DP
coordinator's restarts.

Tasks (`GuardedTasks`: kept, and one that fails ends the client): the output reader (hands
outputs to the listener), the ROUTER drain (a restarted engine's first message arrives there),
the DP coordinator reader, and the watches of `EngineWatch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import zmq
import zmq.asyncio

from treadle.config import EngineConfig
from treadle.core.engine_stop import RELEASE
from treadle.frontend.core_client import (
    AttachTo,
    EngineDeadError,
    MPClient,
    RequestKilledEngineError,
    settle_utility,
)
from treadle.frontend.engine_events import StallKill
from treadle.frontend.engine_rejoin import EngineJoins
from treadle.frontend.engine_restarts import EngineRestarts
from treadle.frontend.engine_scale import EngineScaler
from treadle.frontend.engine_state import EngineState, RestartMode
from treadle.frontend.engine_watch import ENGINE_PING_TIMEOUT_S, EngineWatch, GuardedTasks
from treadle.frontend.inflight import InFlight
from treadle.frontend.startup import StartupProgress
from treadle.frontend.supervisor_reports import SupervisorReports, reports_address
from treadle.ipc.inbound import inbound_options
from treadle.ipc.process import ChildProcess, chain_signal_handlers, signal_children
from treadle.ipc.zmq_utils import make_zmq_socket
from treadle.logger import init_logger
from treadle.wire.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType

logger = init_logger(__name__)


class ClientListener(Protocol):
    """What the client tells its owner (`AsyncLLM`), given at construction. Each runs in the
    event loop (`on_dead` and `on_stopped` once, and only one of them)."""

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Every engine's outputs (checked by `OutputReader`)."""

    def on_failed(self, rank: int, request_ids: list[str], error: Exception) -> None:
        """These requests end with `error` (the dead-letter rule: `RequestKilledEngineError`)."""

    def on_event(self, kind: str, engine: int, count: int) -> None:
        """Counts "restarted" engines, "resumed" and "poisoned" requests."""

    def on_dead(self, reason: str) -> None:
        """The engines are gone for good: every request fails, /health 503, exit 1."""

    def on_stopped(self, reason: str) -> None:
        """An engine was stopped on purpose (`stop_this_process` stops the server as SIGTERM
        does)."""

    def on_resize(self, num_engines: int) -> None:
        """Engines were added, or the highest removed (`POST /scale`, `engine_scale.py`)."""


class AsyncMPClient(MPClient):
    """For the API server: every event goes to `listener`; who restarts the engines is
    `mode` (`RestartMode`), set here once."""

    def __init__(
        self,
        config: EngineConfig,
        listener: ClientListener,
        shutdown_timeout: float = 0.0,
        client_index: int = 0,
        attach: AttachTo | None = None,
        progress: StartupProgress | None = None,
    ):
        # Set before the engines start: shutdown() (also on a failed start) reads them.
        self.listener = listener
        self.progress = progress
        self.loop: asyncio.AbstractEventLoop | None = None
        self._utility: dict[int, asyncio.Future[Any]] = {}
        self._utility_engine: dict[int, int] = {}  # call id -> engine
        self._async_input: zmq.asyncio.Socket | None = None
        self.tasks = GuardedTasks(self.fail, lambda: self._closed)
        self._ended = False  # dead or stopped: told once
        self._pending_end: tuple[str, bool] | None = None
        self._monitors: list[tuple[zmq.Socket[Any], zmq.Socket[Any]]] = []  # (socket, monitor)
        self._restore_signals: Callable[[], None] = lambda: None
        p = config.parallel
        local_ranks = range(
            p.data_parallel_start_rank, p.data_parallel_start_rank + p.local_engine_count
        )
        self.mode = RestartMode.of(attach is None, config.restart.max_engine_restarts)
        # A stalled engine is killed where it is restarted: ours, or one of the supervisor's
        # on this host (it kills it when an API server asks: `StallKill`, once per process).
        kills = self.mode in (RestartMode.OWN, RestartMode.FOLLOW)
        self.killable = frozenset(local_ranks if kills else ())
        self._supervisor = os.getppid() if attach is not None else None  # started us
        self._supervisor_notes = attach.supervisor if attach is not None else None
        self._notes: zmq.Socket[Any] | None = None
        self._reports_out: zmq.Socket[Any] | None = None
        self.inflight = InFlight()
        self.restarts = EngineRestarts(
            self,
            p.data_parallel_size,
            config.restart,
            max_waiting=4 * config.scheduler.max_num_seqs,
        )
        # Before the engines start: the process monitor reports to it.
        self.watch = EngineWatch(
            self, self.restarts, self.mode, local_ranks, p.data_parallel_size, attach is None
        )
        # Restarted engines, and remote ones that rejoin, say hello on the handshake socket.
        self.keep_handshake = self.mode is RestartMode.OWN
        super().__init__(config, shutdown_timeout, client_index, attach)
        self.router.slots = self.restarts.slots
        self.restarts.started(self.engine_pids)
        desk = self.launcher.desk if self.launcher is not None else None
        self.joins = (
            EngineJoins(self, self.launcher, desk, self.restarts, self.watch)
            if self.launcher is not None and desk is not None
            else None
        )
        self.scaler = EngineScaler(self, p.multi_node, p.local_engine_count)

    def start(self) -> None:
        """Start reading outputs; call from inside the running event loop."""
        self.loop = asyncio.get_running_loop()
        assert self.input_socket is not None and self.output_socket is not None
        self._async_input = zmq.asyncio.Socket.from_socket(self.input_socket)
        self.spawn(self._read_outputs(), "engine output reader")
        self.spawn(self._drain_requests(self._async_input), "request socket reader")
        if self.coordinator_socket is not None:
            self.spawn(self._read_coordinator(), "DP coordinator reader")
        if self.joins is not None:
            self.spawn(self.joins.run(), "handshake socket reader")
        watched = []
        for sock, name in ((self.input_socket, "request"), (self.output_socket, "output")):
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitors.append((sock, monitor))
            watched.append((monitor, name))
        self.watch.start(self.tasks, watched)
        if self._supervisor_notes is not None and self.mode is RestartMode.FOLLOW:
            # The supervisor's events, and ours to it (`engine_events.py`): both bound here,
            # so that our files go with us.
            self._notes = make_zmq_socket(
                self.ctx, self._supervisor_notes, zmq.SUB, True, linger=0, options=inbound_options()
            )
            self._notes.setsockopt(zmq.SUBSCRIBE, b"")
            out = make_zmq_socket(
                self.ctx, reports_address(self._supervisor_notes), zmq.PUSH, True, linger=0
            )
            self._reports_out = out
            reports = SupervisorReports(out)
            self.watch.publish = reports.send
            self.spawn(self.watch.watch_supervisor(self._notes), "supervisor reader")
            self.spawn(reports.retry(), "supervisor report retries")
            self.spawn(self.watch.ask(self.client_index), "supervisor question")
        if self._pending_end is not None:  # an engine ended before the loop ran
            self._end(*self._pending_end)
        self._chain_stop_signals()

    def _chain_stop_signals(self) -> None:
        """uvicorn's SIGTERM/SIGINT handlers wait for open streams: pass the signal on at once
        to whoever can end them, so that the server stops without cutting them. Our engines
        get SIGUSR1 (a graceful stop: after --shutdown-timeout they abort what still runs,
        and answer it); an API server of several asks its supervisor, which stops all."""
        supervisor = self._supervisor

        def pass_on() -> None:
            if self._ended:  # the engines stopped (or died) first
                return
            if self.launcher is not None:
                signal_children(self.launcher.engines, signal.SIGUSR1)
            elif supervisor is not None and os.getppid() == supervisor:  # still ours
                with contextlib.suppress(ProcessLookupError):
                    os.kill(supervisor, signal.SIGTERM)

        self._restore_signals = chain_signal_handlers((signal.SIGTERM, signal.SIGINT), pass_on)

    def spawn(self, coro: Coroutine[Any, Any, None], what: str, fatal: bool = True) -> None:
        """A background task, kept; one that raises is logged (and, `fatal`, ends the client)."""
        self.tasks.spawn(coro, what, fatal)

    # -- the tasks ------------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        assert self.output_socket is not None
        sock = zmq.asyncio.Socket.from_socket(self.output_socket)
        while True:
            item = self.reader.read(await sock.recv_multipart(copy=False))
            if item is None:
                continue
            if not isinstance(item, EngineCoreOutputs):  # a death or a stop
                if not self.watch.on_control_frame(item):
                    return  # the client ended
                continue  # (other engines may still finish their requests)
            if self.engine_states[item.engine_index] is EngineState.LOST:
                continue  # (it went silent, yet runs: its requests run elsewhere now)
            if item.utility_output is not None:
                self._utility_engine.pop(item.utility_output.call_id, None)
                settle_utility(self._utility, item.utility_output)
                continue
            self.router.note_finished(item)
            progressed = self.inflight.on_outputs(item)
            self.listener.on_outputs(item)
            await self.restarts.on_outputs(item, progressed)

    async def _drain_requests(self, sock: zmq.asyncio.Socket) -> None:
        """Engines send nothing on the request socket but their first message on each
        connection (`MPClient._admit`): a new launch of an engine is a restarted one (ours,
        or the supervisor's), the same launch one that connected again."""
        while True:
            admitted = self._admit(await sock.recv_multipart(copy=False))
            if admitted is None:
                continue
            rank, new, hello = admitted
            if new:
                await self.watch.on_new_launch(rank, hello.pid)
            else:
                logger.info("EngineCore_DP%d connected to the request socket again", rank)

    async def _read_coordinator(self) -> None:
        assert self.coordinator_socket is not None
        sock = zmq.asyncio.Socket.from_socket(self.coordinator_socket)
        while True:
            self._on_dp_stats(await sock.recv())

    # -- the end --------------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        return self._ended or self._closed

    def _mark_dead(self, reason: str) -> None:
        self._end_threadsafe(reason, stopped=False)

    def _mark_stopped(self, reason: str) -> None:
        self._end_threadsafe(reason, stopped=True)

    def _end_threadsafe(self, reason: str, stopped: bool) -> None:
        """`_end` from the process monitor's thread (or before the loop runs: at `start`).
        After the loop has closed (the server is down and a child's exit is seen late) there
        is no one left to tell: the reason is kept, nothing else."""
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._end, reason, stopped)
            except RuntimeError:  # the event loop is closed
                self.dead_reason = self.dead_reason or reason
        elif self._pending_end is None:
            self.dead_reason, self._pending_end = reason, (reason, stopped)

    def fail(self, reason: str) -> None:
        self._end(reason, stopped=False)

    def stop(self, reason: str) -> None:
        self._end(reason, stopped=True)

    def _end(self, reason: str, stopped: bool) -> None:
        """No more work: fail pending utility calls, then tell the listener."""
        if self.ended:
            return
        self._ended = True
        self.dead_reason = self.dead_reason or reason
        for fut in self._utility.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._utility.clear()
        self._utility_engine.clear()
        self.restarts.wake_all()  # requests waiting for a restart fail now
        if stopped:
            logger.info("%s; stopping", reason[:1].upper() + reason[1:])
            self.listener.on_stopped(reason)
        else:
            self.listener.on_dead(reason)

    # -- requests and calls ---------------------------------------------------------------

    async def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        """Send a request to its engine; while that engine restarts, wait (at most
        4 x max_num_seqs requests wait; more get `EngineDeadError`, a 503)."""
        self._check_alive()
        rank = self.router.route(request, data_parallel_rank)
        while rank < self.num_engines and not self.restarts.is_up(
            rank
        ):  # (it may die again before this one wakes)
            try:
                await self.restarts.wait_up(rank)
            except OverflowError as e:
                self.router.owners([request.request_id])
                raise EngineDeadError(str(e)) from None
            except asyncio.CancelledError:  # its client left while it waited
                self.router.owners([request.request_id])
                raise
        state = self.engine_states[rank] if rank < self.num_engines else EngineState.LOST
        if self.dead_reason is not None or not state.serves:  # (lost, or removed: draining)
            self.router.owners([request.request_id])
            death = self.restarts.slots[rank].last_death if rank < self.num_engines else None
            why = f"engine core {rank} is {state}" + (f" ({death.cause})" if death else "")
            if state is EngineState.DRAINING:
                why += ": it is being removed (POST /scale); send to another rank"
            raise EngineDeadError(self.dead_reason or why)
        self.restarts.on_send(rank)
        self.inflight.add(request, rank)
        await self.send_add(rank, request)

    async def send_add(self, rank: int, request: EngineCoreRequest) -> None:
        assert self._async_input is not None
        frames = self._frames(self.engines.identity(rank), EngineCoreRequestType.ADD, request)
        await self._async_input.send_multipart(frames, copy=False)

    async def send_abort(self, rank: int, request_ids: list[str]) -> None:
        if request_ids and self._async_input is not None:
            ident = self.engines.identity(rank)
            frames = self._frames(ident, EngineCoreRequestType.ABORT, request_ids)
            await self._async_input.send_multipart(frames)

    async def abort_requests(self, request_ids: list[str]) -> None:
        self.inflight.remove(request_ids)
        if request_ids and self.dead_reason is None and self._async_input is not None:
            for frames in self._abort_frames(request_ids):
                await self._async_input.send_multipart(frames)
        await self.restarts.on_abort(request_ids)

    async def call_utility(self, method: str, *args: Any, engine: int = 0) -> Any:
        self._check_alive()
        assert self.loop is not None and self._async_input is not None
        if engine >= self.num_engines:
            raise EngineDeadError(f"engine core {engine} was removed (POST /scale)")
        if not self.restarts.is_up(engine) or self.engine_states[engine] is EngineState.LOST:
            raise EngineDeadError(f"engine core {engine} is {self.engine_states[engine]}")
        call_id = next(self._call_ids)
        frames = self._utility_frames(engine, call_id, method, args)
        fut: asyncio.Future[Any] = self.loop.create_future()
        self._utility[call_id] = fut
        self._utility_engine[call_id] = engine
        await self._async_input.send_multipart(frames)
        return await fut

    async def release(self, rank: int) -> None:
        """Ask engine `rank` (another host's, that `POST /scale` removes) to stop as SIGUSR1
        would: it says STOPPED and exits 0 (its answer to the call is not awaited)."""
        if self._async_input is not None:
            frames = self._utility_frames(rank, next(self._call_ids), RELEASE, ())
            await self._async_input.send_multipart(frames)

    def fail_calls(self, rank: int, cause: str) -> None:
        for call_id, engine in list(self._utility_engine.items()):
            if engine == rank:
                del self._utility_engine[call_id]
                fut = self._utility.pop(call_id, None)
                if fut is not None and not fut.done():
                    fut.set_exception(EngineDeadError(cause))

    def fail_poisoned(self, rank: int, request_ids: list[str], cause: str) -> None:
        self.listener.on_failed(rank, request_ids, RequestKilledEngineError.of(cause))

    def on_event(self, kind: str, engine: int, count: int) -> None:
        self.listener.on_event(kind, engine, count)

    # -- engine and coordinator restarts (issue 14) ---------------------------------------

    @property
    def engine_states(self) -> list[EngineState]:
        return self.restarts.states

    def readiness(self) -> str | None:
        """None when every engine is up, resumed what it had, and makes progress; else why
        not (for /health/ready)."""
        return self.dead_reason or self.restarts.readiness()

    def _on_child_death(self, child: ChildProcess) -> None:
        """(The process monitor's thread.) A dead engine core or DP coordinator of ours is
        restarted; one that exited 0 was stopped on purpose."""
        if self.scaler.retired(child):  # stopped by `POST /scale`
            self.watch.note_exit(child, on_purpose=True)
        elif not self.watch.on_child_death(child):
            super()._on_child_death(child)

    async def respawn(self, rank: int) -> None:
        assert self.launcher is not None and self.monitor is not None and self.joins is not None
        hello = self.watch.expect_hello(rank)
        try:
            child = await asyncio.to_thread(self.launcher.start_again, rank)
            await self.joins.handshake(rank, child)  # (on the handshake socket, kept open)
            self.monitor.add(child)
            await asyncio.wait_for(hello, ENGINE_PING_TIMEOUT_S)
        finally:
            self.watch.forget_hello(rank)

    def kill(self, rank: int) -> None:
        """Kill the stalled engine of `rank`: ours, or the supervisor kills its own."""
        slot = self.restarts.slots[rank]
        if self.launcher is not None:
            with contextlib.suppress(ProcessLookupError):
                self.launcher.engines[rank - self.launcher.start_rank].process.kill()
        elif self.watch.publish is not None and slot.pid > 0:
            self.watch.publish(StallKill(rank, slot.pid, slot.kill_cause or "it stalled"))

    async def respawn_coordinator(self) -> None:
        assert self.launcher is not None and self.monitor is not None
        self.monitor.add(await asyncio.to_thread(self.launcher.restart_coordinator))

    def shutdown(self, timeout: float = 5.0) -> None:
        self.tasks.cancel()
        self._restore_signals()
        if not self._closed:  # the context's term() waits for every socket, monitors too
            for sock in (self._notes, self._reports_out):
                if sock is not None:
                    sock.close(linger=0)
            for sock, monitor in self._monitors:
                sock.disable_monitor()
                monitor.close(linger=0)
        super().shutdown(timeout)


def stop_this_process(reason: str) -> None:
    """What an API server does when its engine was stopped on purpose: stop as SIGTERM does
    (uvicorn shuts down gracefully and the CLI exits 0)."""
    os.kill(os.getpid(), signal.SIGTERM)
