"""Engine-core clients: the front end's side of channels 1 and 2 and of the handshake.

`MPClient` starts the engine core process(es) (`launcher.py`), binds a ROUTER (requests) and a
PULL (outputs), runs the handshake, and watches the processes; with DP it routes each request
to one engine and follows the DP coordinator's load snapshots. `SyncMPClient` (the offline `LLM`) reads outputs
on a thread into a queue; `AsyncMPClient` (the API server) reads them in an asyncio task.
`InprocClient` drives an `EngineCore` in this process (`TREADLE_ENABLE_MULTIPROCESSING=0`).

Engine death, seen as the in-band `ENGINE_CORE_DEAD` frame, the process sentinel or a reader
that fails (logged with its traceback), fails every pending output wait and utility call with
`EngineDeadError`. An engine stopped on purpose (the frame `ENGINE_CORE_STOPPED`, or exit code
0) answered every request first: the client refuses new work (`EngineDeadError`, so `/health`
is 503), and the API server stops cleanly (`AsyncMPClient.on_stopped`). What arrives on the
PULL is checked by `OutputReader`; anything that arrives on the ROUTER after start-up (engines
send nothing there) is read and dropped, so unread input cannot pile up.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import itertools
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from treadle import envs
from treadle.config import EngineConfig
from treadle.core.engine_core_proc import (
    ENGINE_CORE_DEAD,
    ENGINE_CORE_STOPPED,
    Handshake,
    UtilityRequest,
)
from treadle.frontend.engine_router import EngineRouter
from treadle.frontend.inflight import InFlight
from treadle.frontend.launcher import EngineLauncher, front_end_host
from treadle.frontend.output_reader import OutputReader
from treadle.ipc.inbound import DropLog, check_outbound, inbound_options
from treadle.ipc.process import (
    ChildProcess,
    ProcessMonitor,
    chain_signal_handlers,
    describe_exit,
    signal_children,
)
from treadle.ipc.serial import MsgpackEncoder
from treadle.ipc.zmq_utils import (
    engine_identity,
    get_bound_address,
    get_open_zmq_ipc_path,
    get_tcp_uri,
    make_zmq_socket,
)
from treadle.logger import init_logger
from treadle.wire.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
)
from treadle.worker.worker import check_config

logger = init_logger(__name__)

# How long an engine may take to answer when a peer left the request socket (a step of a long
# prefill must fit): one that does not answer is dead.
ENGINE_PING_TIMEOUT_S = 10.0
# --max-engine-restarts counts the restarts in this window.
ENGINE_RESTART_WINDOW_S = 600


# Clients whose engine process still runs. At interpreter exit, multiprocessing joins every
# child it started, and an engine core waits for its parent to go: a client nobody shut down
# (an `LLM` held in a global) would hang the exit. This hook, registered after
# multiprocessing's own, runs before it.
_live_clients: weakref.WeakSet[MPClient] = weakref.WeakSet()


@atexit.register
def _shutdown_live_clients() -> None:
    for client in list(_live_clients):
        client.shutdown()


class EngineDeadError(RuntimeError):
    """The engine core process died; requests in flight cannot finish."""


@dataclass(frozen=True)
class EngineInfo:
    """What the engine found at start-up (returned, never written into the config)."""

    num_blocks: int
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class AttachTo:
    """For an API server whose engines were started by another process (the `treadle serve`
    supervisor): `report(addresses)` hands this client's ROUTER and PULL addresses to the
    process that runs the handshake; `coordinator` is the DP coordinator's XPUB, if any."""

    report: Callable[[list[str]], None]
    coordinator: str | None = None


class MPClient:
    """The front end's side of channels 1 and 2, to one or several (DP) engine cores.

    Without `attach`, this client starts the engines (and the DP coordinator) itself, runs the
    handshake and watches them. Each ADD goes to the engine that `EngineRouter` picks; an
    ABORT only to the engine that owns the request.
    """

    def __init__(
        self,
        config: EngineConfig,
        shutdown_timeout: float = 0.0,
        client_index: int = 0,
        attach: AttachTo | None = None,
    ):
        p = config.parallel
        self.client_index = client_index
        self.num_engines = p.data_parallel_size
        self.identities = [engine_identity(rank) for rank in range(self.num_engines)]
        self.encoder = MsgpackEncoder()
        self.request_drops = DropLog(logger)  # what arrives on the ROUTER after start-up
        self.dead_reason: str | None = None
        self._call_ids = itertools.count()
        self._closed = False
        self.monitor: ProcessMonitor | None = None
        self.launcher: EngineLauncher | None = None
        self.input_socket: zmq.Socket[Any] | None = None
        self.output_socket: zmq.Socket[Any] | None = None
        self.coordinator_socket: zmq.Socket[Any] | None = None
        self.router = EngineRouter(self.num_engines)
        if attach is None:
            # Start the engines before this process makes its zmq context: the context's IO
            # threads would make forking unsafe. DEALERs that connect early are retried by zmq.
            self.launcher = EngineLauncher(config, shutdown_timeout)
            _live_clients.add(self)
        self.ctx: zmq.Context[Any] = zmq.Context()
        try:
            host = front_end_host(config)

            def address() -> str:
                return get_tcp_uri(host, 0) if host else get_open_zmq_ipc_path()

            limits = inbound_options()
            # HANDOVER: a restarted engine core takes over its identity at once, even if the
            # dead one's connection is not cleaned up yet.
            self.input_socket = make_zmq_socket(
                self.ctx,
                address(),
                zmq.ROUTER,
                linger=0,
                options={**limits, zmq.ROUTER_HANDOVER: 1},
            )
            self.output_socket = make_zmq_socket(
                self.ctx, address(), zmq.PULL, linger=0, options=limits
            )
            mine = [get_bound_address(self.input_socket), get_bound_address(self.output_socket)]
            self.addresses = mine
            if self.launcher is not None:
                self.launcher.handshake(self.ctx, [mine[0]], [mine[1]])
                coordinator = self.launcher.coordinator_addresses(1.0)
                coordinator_address = coordinator.front_publish if coordinator else None
            else:
                assert attach is not None
                attach.report(mine)
                coordinator_address = attach.coordinator
            self.info = self._wait_for_engines()
            self.reader = OutputReader(self.num_engines, self.info.vocab_size)
            if coordinator_address:
                self.coordinator_socket = make_zmq_socket(
                    self.ctx, coordinator_address, zmq.SUB, linger=0, options=limits
                )
                self.coordinator_socket.setsockopt(zmq.SUBSCRIBE, b"")
        except BaseException:
            self.shutdown()
            raise
        if self.launcher is not None:
            self.monitor = ProcessMonitor(self.launcher.children, self._on_child_death)

    def _wait_for_engines(self) -> EngineInfo:
        """Wait for each engine's first message on the ROUTER (which registers its identity);
        it carries what the engine found at start-up."""
        assert self.input_socket is not None
        timeout = envs.engine_ready_timeout_s()
        deadline = time.monotonic() + timeout
        decode = msgspec.msgpack.Decoder(Handshake).decode
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        if self.launcher is not None:
            self.launcher.watch(poller)
        infos: dict[bytes, Handshake] = {}
        while len(infos) < self.num_engines:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"only {len(infos)} of {self.num_engines} engine core(s) connected within "
                    f"{timeout} s; raise TREADLE_ENGINE_READY_TIMEOUT_S if loading the model "
                    "takes longer"
                )
            events = dict(poller.poll(int(min(remaining, 1.0) * 1000)))
            if self.launcher is not None:
                self.launcher.check(poller, events)
            if self.input_socket in events:
                frames = self.input_socket.recv_multipart()
                try:
                    identity, payload = frames
                    if identity not in self.identities:
                        raise ValueError(f"unknown engine identity {identity!r}")
                    infos[identity] = decode(payload)
                except Exception as e:
                    self.request_drops.drop("Dropped a message on the request socket: %s", e)
        return EngineInfo(
            num_blocks=min(i.num_blocks for i in infos.values()),
            max_model_len=min(i.max_model_len for i in infos.values()),
            vocab_size=infos[self.identities[0]].vocab_size,
        )

    # -- requests ------------------------------------------------------------------------------

    def _route(self, request: EngineCoreRequest, rank: int | None) -> bytes:
        return self.identities[self.router.route(request, rank)]

    def _abort_frames(self, request_ids: list[str]) -> list[list[Any]]:
        return [
            self._frames(self.identities[rank], EngineCoreRequestType.ABORT, ids)
            for rank, ids in self.router.owners(request_ids).items()
        ]

    def _on_dp_stats(self, payload: bytes) -> None:
        try:
            self.router.on_stats(payload)
        except Exception as e:
            self.request_drops.drop("Dropped a malformed coordinator message: %s", e)

    def _on_stray_request_message(self, frames: list[Any]) -> None:
        size = sum(len(f) for f in frames)
        self.request_drops.drop(
            "Dropped a message on the request socket (%d frames, %d bytes): engines send "
            "nothing there after start-up",
            len(frames),
            size,
        )

    def _frames(self, identity: bytes, kind: EngineCoreRequestType, obj: Any) -> list[Any]:
        frames = [identity, kind.value, *self.encoder.encode(obj)]
        check_outbound(frames, f"this {kind.name} message")  # the engine would refuse it
        return frames

    def _utility_frames(
        self, engine: int, call_id: int, method: str, args: tuple[Any, ...]
    ) -> list[Any]:
        call = UtilityRequest(self.client_index, call_id, method, list(args))
        return self._frames(self.identities[engine], EngineCoreRequestType.UTILITY, call)

    def _on_child_death(self, child: ChildProcess) -> None:
        if child.exitcode == 0:
            self._mark_stopped(f"the {child.name} process stopped")
        else:
            self._mark_dead(f"the {child.name} process died: {describe_exit(child.exitcode)}")

    def _mark_dead(self, reason: str) -> None:
        raise NotImplementedError

    def _mark_stopped(self, reason: str) -> None:
        """An engine (or the coordinator) was stopped on purpose; any thread."""
        raise NotImplementedError

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self.monitor is not None:
            self.monitor.stop()
        if self.launcher is not None:
            self.launcher.shutdown(timeout)
        for sock in (self.input_socket, self.output_socket, self.coordinator_socket):
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()


class SyncMPClient(MPClient):
    """For the offline `LLM`: a thread moves decoded outputs into a queue. The ROUTER is used
    by the caller's thread and the reader's (which drains it), so both hold `_input_lock`."""

    def __init__(self, config: EngineConfig, shutdown_timeout: float = 0.0):
        if config.parallel.data_parallel_size > 1:
            raise ValueError("data parallelism is served by `treadle serve -dp N`, not by LLM")
        super().__init__(config, shutdown_timeout)
        self.outputs: queue.Queue[EngineCoreOutputs | str] = queue.Queue()
        self._utility: dict[int, Future[Any]] = {}
        self._input_lock = threading.Lock()
        self._reader = threading.Thread(target=self._run_reader, name="engine-outputs", daemon=True)
        self._reader.start()

    def _run_reader(self) -> None:
        try:
            self._read_outputs()
        except Exception as e:
            if self._closed:
                return
            logger.exception("The engine output reader failed")
            self._mark_dead(f"the engine output reader failed: {type(e).__name__}: {e}")

    def _read_outputs(self) -> None:
        assert self.output_socket is not None and self.input_socket is not None
        while not self._closed:
            with self._input_lock:
                while self.input_socket.poll(0):
                    self._on_stray_request_message(self.input_socket.recv_multipart())
            if not self.output_socket.poll(200):
                continue
            item = self.reader.read(self.output_socket.recv_multipart(copy=False))
            if item is None:
                continue
            if item == ENGINE_CORE_DEAD:
                self._mark_dead("the engine core reported a fatal error (see its log)")
                return
            if item == ENGINE_CORE_STOPPED:
                self._mark_stopped("the engine core was stopped")
                return
            assert isinstance(item, EngineCoreOutputs)
            if item.utility_output is not None:
                fut = self._utility.pop(item.utility_output.call_id, None)
                if fut is not None:
                    u = item.utility_output
                    if u.failure_message is not None:
                        fut.set_exception(RuntimeError(u.failure_message))
                    else:
                        fut.set_result(u.result)
                continue
            self.outputs.put(item)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            self.outputs.put(reason)
            for fut in list(self._utility.values()):
                fut.set_exception(EngineDeadError(reason))
            self._utility.clear()

    def _mark_stopped(self, reason: str) -> None:
        self._mark_dead(reason)  # no error to log: whoever stopped it knows why

    def _send(self, frames: list[Any], copy: bool = True) -> None:
        assert self.input_socket is not None
        with self._input_lock:
            self.input_socket.send_multipart(frames, copy=copy)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        identity = self._route(request, None)
        self._send(self._frames(identity, EngineCoreRequestType.ADD, request), copy=False)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            for frames in self._abort_frames(request_ids):
                self._send(frames)

    def get_output(self) -> EngineCoreOutputs:
        item = self.outputs.get()
        if isinstance(item, str):
            self.outputs.put(item)  # later callers see it too
            raise EngineDeadError(item)
        return item

    def call_utility(self, method: str, *args: Any, timeout: float | None = 60.0) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        fut: Future[Any] = Future()
        frames = self._utility_frames(0, call_id, method, args)
        self._utility[call_id] = fut
        self._send(frames)
        return fut.result(timeout)


class AsyncMPClient(MPClient):
    """For the API server: asyncio tasks read the outputs (handed to `on_outputs`), drain the
    ROUTER, read the DP coordinator's snapshots and, when the engines are not this process's
    children, watch for engines that disconnect (an engine that vanishes is a dead engine).

    A task that fails is logged with its traceback and makes the engine dead (`on_dead`):
    nothing is left waiting on a reader that is gone. `on_stopped(reason)` runs (in the event
    loop) when an engine was stopped on purpose; by default it sends this process SIGTERM,
    which stops the API server as a signal to it would."""

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_dead: Callable[[str], None],
        shutdown_timeout: float = 0.0,
        client_index: int = 0,
        attach: AttachTo | None = None,
    ):
        # Set before the engines start: shutdown() (also on a failed start) reads them.
        self.on_outputs = on_outputs
        self.on_dead = on_dead
        self.on_stopped: Callable[[str], None] = _stop_this_process
        self.loop: asyncio.AbstractEventLoop | None = None
        self._utility: dict[int, asyncio.Future[Any]] = {}
        self._async_input: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ended = False  # dead or stopped: told once
        self._pending_end: tuple[str, bool] | None = None
        self._monitors: list[tuple[zmq.Socket[Any], zmq.Socket[Any]]] = []  # (socket, monitor)
        self._restore_signals: Callable[[], None] = lambda: None
        self._attached = attach is not None
        # A peer that leaves the request socket may be a dead engine (ping them all) where
        # nobody restarts engines: remote ones, or a supervisor's with restarts off.
        self._watch_disconnects = config.parallel.multi_node or (
            attach is not None and config.restart.max_engine_restarts == 0
        )
        self._supervisor = os.getppid() if attach is not None else None  # started us
        # Engine restarts (issue 14): what each engine has in flight, and each one's state.
        n = config.parallel.data_parallel_size
        self.restart_config = config.restart
        self.inflight = InFlight()
        self.engine_states = ["up"] * n  # up | restarting | resuming
        self.stalled = [False] * n
        self.last_progress = [time.monotonic()] * n
        self.on_event: Callable[[str, int, int], None] = lambda kind, engine, count: None
        self._restart_times: collections.deque[float] = collections.deque()
        self._engine_up = [asyncio.Event() for _ in range(n)]
        for event in self._engine_up:
            event.set()
        self._staged: list[collections.deque[str]] = [collections.deque() for _ in range(n)]
        self._probation: list[str | None] = [None] * n
        self._awaiting_ready: dict[bytes, asyncio.Future[None]] = {}
        self._kill_cause: dict[int, str] = {}
        self._queued = 0
        self._max_queued = 4 * config.scheduler.max_num_seqs
        self._utility_engine: dict[int, int] = {}
        super().__init__(config, shutdown_timeout, client_index, attach)

    def start(self) -> None:
        """Start reading outputs; call from inside the running event loop."""
        self.loop = asyncio.get_running_loop()
        assert self.input_socket is not None
        self._async_input = zmq.asyncio.Socket.from_socket(self.input_socket)
        self._spawn(self._read_outputs(), "engine output reader")
        self._spawn(self._drain_requests(self._async_input), "request socket reader")
        if self.coordinator_socket is not None:
            self._spawn(self._read_coordinator(), "DP coordinator reader")
        self._spawn(self._watch_stalls(), "engine stall watch")
        assert self.output_socket is not None
        for sock, name in ((self.input_socket, "request"), (self.output_socket, "output")):
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitors.append((sock, monitor))
            self._spawn(self._watch_peers(monitor, name), f"{name} socket watch")
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

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        assert self.loop is not None
        self._tasks.append(self.loop.create_task(self._guard(coro, what)))

    async def _guard(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if self._closed:
                return
            logger.exception("The %s failed", what)
            self._fail(f"the front end's {what} failed: {type(e).__name__}: {e}")

    async def _read_outputs(self) -> None:
        assert self.output_socket is not None
        sock = zmq.asyncio.Socket.from_socket(self.output_socket)
        while True:
            item = self.reader.read(await sock.recv_multipart(copy=False))
            if item is None:
                continue
            if item == ENGINE_CORE_DEAD:
                if self.can_restart or self.follows_restarts:  # it exits, and is restarted
                    logger.warning("An engine core reported a fatal error (see its log)")
                    continue
                self._fail("an engine core reported a fatal error (see its log)")
                return
            if item == ENGINE_CORE_STOPPED:
                self._end("an engine core was stopped", stopped=True)
                continue  # other engines may still finish their requests
            assert isinstance(item, EngineCoreOutputs)
            if item.utility_output is not None:
                u = item.utility_output
                self._utility_engine.pop(u.call_id, None)
                fut = self._utility.pop(u.call_id, None)
                if fut is not None and not fut.done():
                    if u.failure_message is not None:
                        fut.set_exception(RuntimeError(u.failure_message))
                    else:
                        fut.set_result(u.result)
                continue
            self.router.note_finished(item)
            self._note_progress(item)
            progressed = self.inflight.on_outputs(item)
            self.on_outputs(item)
            probation = self._probation[item.engine_index]
            if probation is not None and probation in progressed:
                await self._release_next(item.engine_index)

    async def _drain_requests(self, sock: zmq.asyncio.Socket) -> None:
        """Engines send nothing on the request socket after start-up, but for the first
        message of a restarted engine core (its identity, and what it found at start-up)."""
        while True:
            frames = await sock.recv_multipart(copy=False)
            identity = frames[0].bytes if len(frames) == 2 else b""
            ready = self._awaiting_ready.get(identity)
            if ready is not None and not ready.done():
                ready.set_result(None)
                continue
            if self.follows_restarts and identity in self.identities and _is_hello(frames[1]):
                # our supervisor restarted this engine: its old process is gone
                rank = self.identities.index(identity)
                self._engine_down(rank, f"EngineCore_DP{rank} was restarted (its process died)")
                await self._engine_back(rank, "(restarted by the supervisor)")
                continue
            self._on_stray_request_message(frames)

    async def _read_coordinator(self) -> None:
        assert self.coordinator_socket is not None
        sock = zmq.asyncio.Socket.from_socket(self.coordinator_socket)
        while True:
            self._on_dp_stats(await sock.recv())

    async def _watch_peers(self, monitor: zmq.Socket[Any], name: str) -> None:
        """Log each peer that leaves the socket `name` (libzmq drops a peer that sends more
        than TREADLE_ZMQ_MAX_MSG_BYTES this way). When the engines are not our children, a
        peer leaving the request socket may be an engine whose process or host is gone: every
        engine must then answer a call within ENGINE_PING_TIMEOUT_S or it is dead (a bare
        disconnect would let any local process that connects and leaves kill the server)."""
        sock = zmq.asyncio.Socket.from_socket(monitor)
        while True:
            event = parse_monitor_message(await sock.recv_multipart())
            if event["event"] != zmq.EVENT_DISCONNECTED or self._ended:
                continue
            if name == "request" and self._watch_disconnects:
                silent = await self._silent_engines()
                if silent:
                    self._fail(f"engine core(s) {silent} disconnected and do not answer")
                    return
            logger.warning(
                "A peer of the %s socket disconnected (it closed, or sent a message larger "
                "than TREADLE_ZMQ_MAX_MSG_BYTES=%d)",
                name,
                envs.zmq_max_msg_bytes(),
            )

    async def _silent_engines(self) -> list[int]:
        async def answers(engine: int) -> bool:
            try:
                await asyncio.wait_for(self.call_utility("get_stats", engine=engine), timeout)
                return True
            except (TimeoutError, EngineDeadError):
                return False

        timeout = ENGINE_PING_TIMEOUT_S
        replies = await asyncio.gather(*(answers(e) for e in range(self.num_engines)))
        return [e for e, ok in enumerate(replies) if not ok]

    def _mark_dead(self, reason: str) -> None:
        self._end_threadsafe(reason, stopped=False)

    def _mark_stopped(self, reason: str) -> None:
        self._end_threadsafe(reason, stopped=True)

    def _end_threadsafe(self, reason: str, stopped: bool) -> None:
        """`_end` from the process monitor's thread (or before the loop runs: at `start`)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._end, reason, stopped)
        elif self._pending_end is None:
            self.dead_reason, self._pending_end = reason, (reason, stopped)

    def _fail(self, reason: str) -> None:
        self._end(reason, stopped=False)

    def _end(self, reason: str, stopped: bool) -> None:
        """No more work: fail pending utility calls, then `on_dead` (a failure: every
        request fails, /health 503, exit 1) or `on_stopped` (requests were answered)."""
        if self._ended or self._closed:
            return
        self._ended = True
        self.dead_reason = self.dead_reason or reason
        for fut in self._utility.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._utility.clear()
        self._utility_engine.clear()
        if stopped:
            logger.info("%s; stopping", reason[:1].upper() + reason[1:])
            self.on_stopped(reason)
        else:
            self.on_dead(reason)

    async def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        """Send a request to its engine; while that engine restarts, wait (at most
        4 x max_num_seqs requests wait; more get `EngineDeadError`, a 503)."""
        self._check_alive()
        assert self._async_input is not None
        rank = self.router.route(request, data_parallel_rank)
        if not self._engine_up[rank].is_set():
            if self._queued >= self._max_queued:
                self.router.owners([request.request_id])
                raise EngineDeadError(
                    f"engine core {rank} is restarting and {self._queued} requests wait for "
                    "it already: try again in a few seconds"
                )
            self._queued += 1
            try:
                await self._engine_up[rank].wait()
            except asyncio.CancelledError:  # its client left while it waited
                self.router.owners([request.request_id])
                raise
            finally:
                self._queued -= 1
            self._check_alive()
        if self.inflight.count(rank) == 0:
            self.last_progress[rank] = time.monotonic()  # its work starts now
        self.inflight.add(request, rank)
        await self._async_input.send_multipart(
            self._frames(self.identities[rank], EngineCoreRequestType.ADD, request), copy=False
        )

    async def abort_requests(self, request_ids: list[str]) -> None:
        self.inflight.remove(request_ids)
        if request_ids and self.dead_reason is None and self._async_input is not None:
            for frames in self._abort_frames(request_ids):
                await self._async_input.send_multipart(frames)
        for rank, probation in enumerate(self._probation):
            if probation is not None and probation in request_ids:
                await self._release_next(rank)

    async def call_utility(self, method: str, *args: Any, engine: int = 0) -> Any:
        self._check_alive()
        assert self.loop is not None and self._async_input is not None
        if not self._engine_up[engine].is_set():
            raise EngineDeadError(f"engine core {engine} is restarting")
        call_id = next(self._call_ids)
        frames = self._utility_frames(engine, call_id, method, args)
        fut: asyncio.Future[Any] = self.loop.create_future()
        self._utility[call_id] = fut
        self._utility_engine[call_id] = engine
        await self._async_input.send_multipart(frames)
        return await fut

    # -- engine restarts (issue 14) ------------------------------------------------------------

    @property
    def can_restart(self) -> bool:
        """This client started its engines (so it can start them again) and may."""
        return self.launcher is not None and self.restart_config.max_engine_restarts > 0

    @property
    def follows_restarts(self) -> bool:
        """The `treadle serve` supervisor started these engines and restarts them; this
        client resumes its requests when a restarted one says hello."""
        return self._attached and self.restart_config.max_engine_restarts > 0

    def readiness(self) -> str | None:
        """None when every engine is up, resumed what it had, and makes progress; else why
        not (for /health/ready)."""
        if self.dead_reason is not None:
            return self.dead_reason
        for rank, state in enumerate(self.engine_states):
            if state != "up":
                return f"engine core {rank} is {state}"
            if self.stalled[rank]:
                idle = time.monotonic() - self.last_progress[rank]
                return f"engine core {rank} has requests but finished no step for {idle:.0f} s"
        return None

    def _on_child_death(self, child: ChildProcess) -> None:
        """(The process monitor's thread.) A dead engine core of ours is restarted."""
        launcher, loop = self.launcher, self.loop
        if child.exitcode != 0 and self.can_restart and launcher is not None and loop is not None:
            for i, engine in enumerate(launcher.engines):
                if engine is child:
                    cause = f"the {child.name} process died: {describe_exit(child.exitcode)}"
                    loop.call_soon_threadsafe(self._engine_died, launcher.start_rank + i, cause)
                    return
        super()._on_child_death(child)

    def _engine_died(self, rank: int, cause: str) -> None:
        """Restart our dead engine (if the budget allows) and resume its requests."""
        if self._ended or self._closed:
            return
        cause = self._kill_cause.pop(rank, cause)
        now = time.monotonic()
        limit = self.restart_config.max_engine_restarts
        while self._restart_times and now - self._restart_times[0] > ENGINE_RESTART_WINDOW_S:
            self._restart_times.popleft()
        if len(self._restart_times) >= limit:
            self._fail(
                f"{cause}; it was restarted {limit} time(s) in the last "
                f"{ENGINE_RESTART_WINDOW_S / 60:.0f} minutes already (--max-engine-restarts)"
            )
            return
        self._restart_times.append(now)
        self._engine_down(
            rank, f"{cause}. Restarting it (restart {len(self._restart_times)} of at most "
            f"{limit} in {ENGINE_RESTART_WINDOW_S // 60} minutes)"
        )  # fmt: skip
        self._spawn(self._restart(rank, cause, now), f"restart of engine core {rank}")

    def _engine_down(self, rank: int, cause: str) -> None:
        """The engine is gone: new requests wait for it, calls to it fail, and its requests
        are staged to resume, but those the dead-letter rule (`InFlight.on_engine_death`)
        fails: in flight at a death before without progress since."""
        self.engine_states[rank] = "restarting"
        self.stalled[rank] = False
        self.router.down.add(rank)
        self._engine_up[rank].clear()
        self._staged[rank].clear()
        self._probation[rank] = None
        for call_id, engine in list(self._utility_engine.items()):
            if engine == rank:
                del self._utility_engine[call_id]
                fut = self._utility.pop(call_id, None)
                if fut is not None and not fut.done():
                    fut.set_exception(EngineDeadError(cause))
        resume, poisoned = self.inflight.on_engine_death(rank)
        self._staged[rank].extend(resume)
        logger.warning(
            "%s; %d request(s) to resume%s",
            cause[:1].upper() + cause[1:],
            len(resume),
            f", {len(poisoned)} failed: in flight at two engine deaths in a row"
            if poisoned
            else "",
        )
        if poisoned:
            self.router.owners(poisoned)
            reason = (
                "the engine core died twice while running this request; it is not resumed "
                "again (it may be what kills the engine)"
            )
            fails = [
                EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, stop_reason=reason)
                for rid in poisoned
            ]
            self.on_outputs(EngineCoreOutputs(engine_index=rank, outputs=fails))
            self.on_event("poisoned", rank, len(poisoned))

    async def _restart(self, rank: int, cause: str, since: float) -> None:
        assert self.launcher is not None and self.monitor is not None and self.loop is not None
        identity = self.identities[rank]
        ready: asyncio.Future[None] = self.loop.create_future()
        self._awaiting_ready[identity] = ready
        try:
            child = await asyncio.to_thread(
                self.launcher.restart_engine,
                rank,
                self.ctx,
                [self.addresses[0]],
                [self.addresses[1]],
            )
            self.monitor.add(child)
            await asyncio.wait_for(ready, ENGINE_PING_TIMEOUT_S)
        except Exception as e:
            self._fail(f"{cause}, and restarting it failed: {type(e).__name__}: {e}")
            return
        finally:
            self._awaiting_ready.pop(identity, None)
        await self._engine_back(rank, f"{time.monotonic() - since:.1f} s after it died")

    async def _engine_back(self, rank: int, when: str) -> None:
        """A new engine core of `rank` is up: new requests go to it, and its staged requests
        resume."""
        if self._ended or self._closed:
            return
        logger.warning(  # a warning, as its death was: a quiet log shows both
            "EngineCore_DP%d is back %s; resuming %d request(s)",
            rank,
            when,
            len(self._staged[rank]),
        )
        self.on_event("restarted", rank, 1)
        self.engine_states[rank] = "resuming"
        self.last_progress[rank] = time.monotonic()
        self.router.down.discard(rank)
        self._engine_up[rank].set()  # new requests go to it again
        await self._release_next(rank)

    async def _release_next(self, rank: int) -> None:
        """Resume the next suspect of a restarted engine: one at a time, each once the one
        before made progress, so that a request that kills the engine again is the only one
        in flight at that second death."""
        assert self._async_input is not None
        staged = self._staged[rank]
        while staged:
            request = self.inflight.resumed(staged.popleft())
            if request is None:  # it was aborted meanwhile
                continue
            self._probation[rank] = request.request_id
            await self._async_input.send_multipart(
                self._frames(self.identities[rank], EngineCoreRequestType.ADD, request), copy=False
            )
            self.on_event("resumed", rank, 1)
            return
        self._probation[rank] = None
        if self.engine_states[rank] == "resuming":
            self.engine_states[rank] = "up"

    def _note_progress(self, item: EngineCoreOutputs) -> None:
        """When the engine finished the step of these outputs (its timestamp, not when they
        were read: a front end that falls behind must not hide a stopped engine)."""
        lag = max(0.0, time.time() - item.timestamp) if item.timestamp else 0.0
        rank = item.engine_index
        self.last_progress[rank] = max(self.last_progress[rank], time.monotonic() - lag)

    async def _watch_stalls(self) -> None:
        """An engine with requests that finishes no step for --engine-stall-timeout is not
        ready (logged once); past --engine-stall-kill-timeout it is killed, and restarted."""
        cfg = self.restart_config
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for rank, state in enumerate(self.engine_states):
                if state == "restarting" or self.inflight.count(rank) == 0:
                    self.last_progress[rank] = now
                    self.stalled[rank] = False
                    continue
                idle = now - self.last_progress[rank]
                if idle <= cfg.engine_stall_timeout:
                    if self.stalled[rank]:
                        logger.warning("EngineCore_DP%d finishes steps again", rank)
                    self.stalled[rank] = False
                    continue
                if not self.stalled[rank]:
                    self.stalled[rank] = True
                    logger.warning(
                        "EngineCore_DP%d has %d request(s) in flight but finished no step for "
                        "%.0f s: not ready until it does",
                        rank,
                        self.inflight.count(rank),
                        idle,
                    )
                kill = cfg.engine_stall_kill_timeout
                if kill > 0 and idle > kill and self.can_restart and rank not in self._kill_cause:
                    self._kill_stalled(rank, idle)

    def _kill_stalled(self, rank: int, idle: float) -> None:
        assert self.launcher is not None
        child = self.launcher.engines[rank - self.launcher.start_rank]
        self._kill_cause[rank] = f"EngineCore_DP{rank} finished no step for {idle:.0f} s"
        logger.error("%s: killing it", self._kill_cause[rank])
        with contextlib.suppress(ProcessLookupError):
            child.process.kill()

    def shutdown(self, timeout: float = 5.0) -> None:
        for task in self._tasks:
            task.cancel()
        self._restore_signals()
        if not self._closed:  # the context's term() waits for every socket, monitors too
            for sock, monitor in self._monitors:
                sock.disable_monitor()
                monitor.close(linger=0)
        super().shutdown(timeout)


def _is_hello(payload: Any) -> bool:
    """Whether a message on the request socket is an engine core's first one (`Handshake`)."""
    try:
        msgspec.msgpack.decode(payload.bytes, type=Handshake)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return True


def _stop_this_process(reason: str) -> None:
    """The default `on_stopped`: stop this process as SIGTERM does (uvicorn shuts down
    gracefully and the CLI exits 0)."""
    os.kill(os.getpid(), signal.SIGTERM)


class InprocClient:
    """The engine core in this process (`TREADLE_ENABLE_MULTIPROCESSING=0`): same calls as
    `SyncMPClient`, `get_output` runs steps itself."""

    def __init__(self, config: EngineConfig):
        from treadle.core.engine_core import EngineCore

        check_config(config)  # the same start-up checks as the launcher's
        self.engine_core = EngineCore(config)
        self.info = EngineInfo(
            self.engine_core.num_blocks, self.engine_core.max_model_len, self.engine_core.vocab_size
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        while self.engine_core.has_unfinished_requests():
            outputs = self.engine_core.step().get(0)
            if outputs is not None:
                return outputs
        return EngineCoreOutputs()

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
