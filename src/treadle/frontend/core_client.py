"""Engine-core clients: the front end's side of channels 1 and 2 and of the handshake.

`MPClient` starts the engine core process(es) (`launcher.py`), binds a ROUTER (requests) and a
PULL (outputs), runs the handshake, and watches the processes; with DP it routes each request
to one engine and follows the DP coordinator's load snapshots. `SyncMPClient` (the offline `LLM`) reads outputs
on a thread into a queue; `AsyncMPClient` (the API server) reads them in an asyncio task.
`InprocClient` drives an `EngineCore` in this process (`TREADLE_ENABLE_MULTIPROCESSING=0`).

Engine death, seen as the in-band `ENGINE_CORE_DEAD` frame or the process sentinel, fails every
pending output wait and utility call with `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from treadle import envs
from treadle.config import EngineConfig
from treadle.core.engine_core_proc import ENGINE_CORE_DEAD, Handshake, UtilityRequest
from treadle.frontend.launcher import EngineLauncher, front_end_host
from treadle.ipc.process import ChildProcess, ProcessMonitor, describe_exit
from treadle.ipc.serial import MsgpackDecoder, MsgpackEncoder
from treadle.ipc.zmq_utils import (
    engine_identity,
    get_bound_address,
    get_open_zmq_ipc_path,
    get_tcp_uri,
    make_zmq_socket,
)
from treadle.logger import init_logger
from treadle.wire.engine import (
    DPStats,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
)
from treadle.worker.worker import check_config

logger = init_logger(__name__)


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
    handshake and watches them. Each ADD goes to one engine: the explicit `data_parallel_rank`
    or the lowest score `4 * waiting + running` from the coordinator's last snapshot plus what
    this client sent since (ties: fewest prompt tokens in flight from here, so that long
    prompts spread out; then in turn). An ABORT goes only to the engine that owns the request.
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
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.dead_reason: str | None = None
        self._call_ids = itertools.count()
        self._closed = False
        self.monitor: ProcessMonitor | None = None
        self.launcher: EngineLauncher | None = None
        self.input_socket: zmq.Socket[Any] | None = None
        self.output_socket: zmq.Socket[Any] | None = None
        self.coordinator_socket: zmq.Socket[Any] | None = None
        # Load balancing: per engine [waiting, running] (coordinator snapshot + own sends).
        self.lb_counts = [[0, 0] for _ in range(self.num_engines)]
        # Prompt tokens of the requests this client has in flight on each engine.
        self.in_flight = [0] * self.num_engines
        self.request_engine: dict[str, tuple[int, int]] = {}  # request id -> (engine, tokens)
        self.current_wave = 0
        self._tie_break = itertools.cycle(range(self.num_engines))
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

            self.input_socket = make_zmq_socket(self.ctx, address(), zmq.ROUTER, linger=0)
            self.output_socket = make_zmq_socket(self.ctx, address(), zmq.PULL, linger=0)
            mine = [get_bound_address(self.input_socket), get_bound_address(self.output_socket)]
            if self.launcher is not None:
                self.launcher.handshake(self.ctx, [mine[0]], [mine[1]])
                coordinator = self.launcher.coordinator_addresses(1.0)
                coordinator_address = coordinator.front_publish if coordinator else None
            else:
                assert attach is not None
                attach.report(mine)
                coordinator_address = attach.coordinator
            self.info = self._wait_for_engines()
            if coordinator_address:
                self.coordinator_socket = make_zmq_socket(
                    self.ctx, coordinator_address, zmq.SUB, linger=0
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
                identity, payload = self.input_socket.recv_multipart()
                if identity in self.identities:
                    infos[identity] = decode(payload)
        return EngineInfo(
            num_blocks=min(i.num_blocks for i in infos.values()),
            max_model_len=min(i.max_model_len for i in infos.values()),
            vocab_size=infos[self.identities[0]].vocab_size,
        )

    # -- requests ------------------------------------------------------------------------------

    def _route(self, request: EngineCoreRequest, rank: int | None) -> bytes:
        """Pick the engine for a new request and remember it (for aborts)."""
        if self.num_engines == 1:
            if rank not in (None, 0):
                raise ValueError(f"data_parallel_rank {rank} out of range: there is 1 engine")
            return self.identities[0]
        if rank is None:
            counts, in_flight, n = self.lb_counts, self.in_flight, self.num_engines
            first = next(self._tie_break)
            rank = min(
                range(n),
                key=lambda e: (4 * counts[e][0] + counts[e][1], in_flight[e], (e - first) % n),
            )
        elif not 0 <= rank < self.num_engines:
            raise ValueError(
                f"data_parallel_rank {rank} out of range: there are {self.num_engines} engines"
            )
        self.lb_counts[rank][0] += 1
        tokens = len(request.prompt_token_ids)
        self.in_flight[rank] += tokens
        self.request_engine[request.request_id] = (rank, tokens)
        request.current_wave = self.current_wave
        return self.identities[rank]

    def _abort_frames(self, request_ids: list[str]) -> list[list[Any]]:
        if self.num_engines == 1:
            return [self._frames(self.identities[0], EngineCoreRequestType.ABORT, request_ids)]
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            owner = self.request_engine.pop(rid, None)
            if owner is not None:  # else it finished already
                rank, tokens = owner
                self.in_flight[rank] -= tokens
                by_engine.setdefault(rank, []).append(rid)
        return [
            self._frames(self.identities[rank], EngineCoreRequestType.ABORT, ids)
            for rank, ids in by_engine.items()
        ]

    def _note_finished(self, outputs: EngineCoreOutputs) -> None:
        if self.num_engines == 1:
            return
        for out in outputs.outputs:
            if out.finish_reason is not None:
                owner = self.request_engine.pop(out.request_id, None)
                if owner is not None:
                    self.in_flight[owner[0]] -= owner[1]

    def _on_dp_stats(self, payload: bytes) -> None:
        try:
            stats = msgspec.msgpack.decode(payload, type=DPStats)
        except msgspec.DecodeError as e:
            logger.error("Dropped a malformed coordinator message: %s", e)
            return
        if len(stats.engines) == self.num_engines:
            self.lb_counts = [[int(w), int(r)] for w, r, _ in stats.engines]
        self.current_wave = stats.wave

    def _frames(self, identity: bytes, kind: EngineCoreRequestType, obj: Any) -> list[Any]:
        return [identity, kind.value, *self.encoder.encode(obj)]

    def _utility_frames(
        self, engine: int, call_id: int, method: str, args: tuple[Any, ...]
    ) -> list[Any]:
        call = UtilityRequest(self.client_index, call_id, method, list(args))
        return self._frames(self.identities[engine], EngineCoreRequestType.UTILITY, call)

    def _on_child_death(self, child: ChildProcess) -> None:
        self._mark_dead(f"the {child.name} process died: {describe_exit(child.exitcode)}")

    def _mark_dead(self, reason: str) -> None:
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
    """For the offline `LLM`: a thread moves decoded outputs into a queue."""

    def __init__(self, config: EngineConfig, shutdown_timeout: float = 0.0):
        if config.parallel.data_parallel_size > 1:
            raise ValueError("data parallelism is served by `treadle serve -dp N`, not by LLM")
        super().__init__(config, shutdown_timeout)
        self.outputs: queue.Queue[EngineCoreOutputs | str] = queue.Queue()
        self._utility: dict[int, Future[Any]] = {}
        self._reader = threading.Thread(
            target=self._read_outputs, name="engine-outputs", daemon=True
        )
        self._reader.start()

    def _read_outputs(self) -> None:
        assert self.output_socket is not None
        while not self._closed:
            try:
                if not self.output_socket.poll(200):
                    continue
                frames = self.output_socket.recv_multipart(copy=False)
            except zmq.ZMQError:
                return
            if len(frames) == 1 and frames[0].bytes == ENGINE_CORE_DEAD:
                self._mark_dead("the engine core reported a fatal error (see its log)")
                return
            outputs: EngineCoreOutputs = self.decoder.decode(frames)
            if outputs.utility_output is not None:
                fut = self._utility.pop(outputs.utility_output.call_id, None)
                if fut is not None:
                    u = outputs.utility_output
                    if u.failure_message is not None:
                        fut.set_exception(RuntimeError(u.failure_message))
                    else:
                        fut.set_result(u.result)
                continue
            self.outputs.put(outputs)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            self.outputs.put(reason)
            for fut in list(self._utility.values()):
                fut.set_exception(EngineDeadError(reason))
            self._utility.clear()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        assert self.input_socket is not None
        identity = self._route(request, None)
        self.input_socket.send_multipart(
            self._frames(identity, EngineCoreRequestType.ADD, request), copy=False
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            assert self.input_socket is not None
            for frames in self._abort_frames(request_ids):
                self.input_socket.send_multipart(frames)

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
        self._utility[call_id] = fut
        assert self.input_socket is not None
        self.input_socket.send_multipart(self._utility_frames(0, call_id, method, args))
        return fut.result(timeout)


class AsyncMPClient(MPClient):
    """For the API server: asyncio tasks read the outputs (handed to `on_outputs`), the DP
    coordinator's snapshots and, when the engines are not this process's children, the
    disconnects of engines (an engine that vanishes is a dead engine)."""

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
        self.loop: asyncio.AbstractEventLoop | None = None
        self._utility: dict[int, asyncio.Future[Any]] = {}
        self._async_input: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._failed = False
        self._watch_disconnects = attach is not None or config.parallel.multi_node
        super().__init__(config, shutdown_timeout, client_index, attach)

    def start(self) -> None:
        """Start reading outputs; call from inside the running event loop."""
        self.loop = asyncio.get_running_loop()
        assert self.input_socket is not None
        self._async_input = zmq.asyncio.Socket.from_socket(self.input_socket)
        self._tasks.append(self.loop.create_task(self._read_outputs()))
        if self.coordinator_socket is not None:
            self._tasks.append(self.loop.create_task(self._read_coordinator()))
        if self._watch_disconnects:
            monitor = self.input_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._tasks.append(self.loop.create_task(self._watch_engines(monitor)))

    async def _read_outputs(self) -> None:
        assert self.output_socket is not None
        sock = zmq.asyncio.Socket.from_socket(self.output_socket)
        while True:
            frames = await sock.recv_multipart(copy=False)
            if len(frames) == 1 and frames[0].bytes == ENGINE_CORE_DEAD:
                self._fail("an engine core reported a fatal error (see its log)")
                return
            try:
                outputs: EngineCoreOutputs = self.decoder.decode(frames)
            except Exception as e:  # never let one bad message stop the reader
                logger.error("Dropped a malformed engine output: %s", e)
                continue
            if outputs.utility_output is not None:
                u = outputs.utility_output
                fut = self._utility.pop(u.call_id, None)
                if fut is not None and not fut.done():
                    if u.failure_message is not None:
                        fut.set_exception(RuntimeError(u.failure_message))
                    else:
                        fut.set_result(u.result)
                continue
            self._note_finished(outputs)
            self.on_outputs(outputs)

    async def _read_coordinator(self) -> None:
        assert self.coordinator_socket is not None
        sock = zmq.asyncio.Socket.from_socket(self.coordinator_socket)
        while True:
            self._on_dp_stats(await sock.recv())

    async def _watch_engines(self, monitor: zmq.Socket[Any]) -> None:
        sock = zmq.asyncio.Socket.from_socket(monitor)
        try:
            while True:
                event = parse_monitor_message(await sock.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._fail("an engine core disconnected (its process or host is gone)")
                    return
        finally:
            monitor.close(linger=0)

    def _mark_dead(self, reason: str) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._fail, reason)
        elif self.dead_reason is None:
            self.dead_reason = reason

    def _fail(self, reason: str) -> None:
        if self._failed or self._closed:
            return
        self._failed = True
        self.dead_reason = self.dead_reason or reason
        for fut in self._utility.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._utility.clear()
        self.on_dead(reason)

    async def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        self._check_alive()
        assert self._async_input is not None
        identity = self._route(request, data_parallel_rank)
        await self._async_input.send_multipart(
            self._frames(identity, EngineCoreRequestType.ADD, request), copy=False
        )

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None and self._async_input is not None:
            for frames in self._abort_frames(request_ids):
                await self._async_input.send_multipart(frames)

    async def call_utility(self, method: str, *args: Any, engine: int = 0) -> Any:
        self._check_alive()
        assert self.loop is not None and self._async_input is not None
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = self.loop.create_future()
        self._utility[call_id] = fut
        await self._async_input.send_multipart(self._utility_frames(engine, call_id, method, args))
        return await fut

    def shutdown(self, timeout: float = 5.0) -> None:
        for task in self._tasks:
            task.cancel()
        super().shutdown(timeout)


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
