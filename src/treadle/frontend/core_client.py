"""Engine-core clients: the front end's side of channels 1 and 2 and of the handshake.

`MPClient` starts the engine core process, binds a ROUTER (requests) and a PULL (outputs),
runs the handshake, and watches the process. `SyncMPClient` (the offline `LLM`) reads outputs
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

from treadle import envs
from treadle.config import EngineConfig
from treadle.core.engine_core_proc import (
    ENGINE_CORE_DEAD,
    Handshake,
    UtilityRequest,
    run_engine_core,
)
from treadle.ipc.process import (
    ChildProcess,
    ProcessMonitor,
    describe_exit,
    shutdown_processes,
    start_process,
)
from treadle.ipc.serial import MsgpackDecoder, MsgpackEncoder
from treadle.ipc.zmq_utils import engine_identity, get_open_zmq_ipc_path, make_zmq_socket
from treadle.logger import init_logger
from treadle.wire.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType

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


class MPClient:
    def __init__(self, config: EngineConfig, shutdown_timeout: float = 0.0, client_index: int = 0):
        self.client_index = client_index
        self.identity = engine_identity(0)
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.dead_reason: str | None = None
        self._call_ids = itertools.count()
        self._closed = False
        self.engine: ChildProcess | None = None
        self.monitor: ProcessMonitor | None = None
        # Start the engine before this process makes its zmq context: the context's IO threads
        # would make forking unsafe. The engine's DEALER connects before the bind; zmq retries.
        handshake_address = get_open_zmq_ipc_path()
        self.engine = start_process(
            run_engine_core, "EngineCore_DP0", args=(config, handshake_address, 0, shutdown_timeout)
        )
        _live_clients.add(self)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.input_socket = make_zmq_socket(self.ctx, get_open_zmq_ipc_path(), zmq.ROUTER, linger=0)
        self.output_socket = make_zmq_socket(self.ctx, get_open_zmq_ipc_path(), zmq.PULL, linger=0)
        handshake = make_zmq_socket(self.ctx, handshake_address, zmq.ROUTER, linger=0)
        try:
            self.info = self._handshake(handshake)
        except BaseException:
            handshake.close(linger=0)
            self.shutdown()
            raise
        handshake.close(linger=0)
        self.monitor = ProcessMonitor([self.engine], self._on_engine_death)

    def _handshake(self, handshake: zmq.Socket[Any]) -> EngineInfo:
        assert self.engine is not None
        timeout = envs.engine_ready_timeout_s()
        deadline = time.monotonic() + timeout
        decode = msgspec.msgpack.Decoder(Handshake).decode
        poller = zmq.Poller()
        poller.register(handshake, zmq.POLLIN)
        poller.register(self.input_socket, zmq.POLLIN)
        poller.register(self.engine.sentinel, zmq.POLLIN)
        poller.register(self.engine.ready_reader.fileno(), zmq.POLLIN)
        info: Handshake | None = None
        registered = False
        while info is None or not registered:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"the engine core was not ready within {timeout} s; raise "
                    "TREADLE_ENGINE_READY_TIMEOUT_S if loading the model takes longer"
                )
            events = dict(poller.poll(int(min(remaining, 1.0) * 1000)))
            if self.engine.ready_reader.fileno() in events:
                self._check_ready_pipe()
            if self.engine.sentinel in events:
                self.engine.process.join(1.0)
                self._check_ready_pipe()
                raise RuntimeError(
                    f"the engine core process died during start-up: {describe_exit(self.engine.exitcode)}"
                )
            if handshake in events:
                identity, payload = handshake.recv_multipart()
                msg = decode(payload)
                if msg.status == "HELLO":
                    addresses = Handshake(
                        "ADDRESSES",
                        inputs=[_address(self.input_socket)],
                        outputs=[_address(self.output_socket)],
                    )
                    handshake.send_multipart([identity, msgspec.msgpack.encode(addresses)])
                elif msg.status == "READY":
                    info = msg
            if self.input_socket in events:
                self.input_socket.recv_multipart()  # the ready message: the identity is now known
                registered = True
        return EngineInfo(info.num_blocks, info.max_model_len, info.vocab_size)

    def _check_ready_pipe(self) -> None:
        """Raise the engine's own start-up error if it sent one on its ready pipe."""
        assert self.engine is not None
        reader = self.engine.ready_reader
        try:
            if reader.poll():
                status, payload = reader.recv()
                if status == "FAILED":
                    logger.error("The engine core failed to start:\n%s", payload)
                    last = str(payload).strip().splitlines()[-1]
                    raise RuntimeError(f"the engine core failed to start: {last}")
        except (EOFError, OSError):
            pass

    # -- requests ------------------------------------------------------------------------------

    def _frames(self, kind: EngineCoreRequestType, obj: Any) -> list[Any]:
        return [self.identity, kind.value, *self.encoder.encode(obj)]

    def _utility_frames(self, call_id: int, method: str, args: tuple[Any, ...]) -> list[Any]:
        call = UtilityRequest(self.client_index, call_id, method, list(args))
        return self._frames(EngineCoreRequestType.UTILITY, call)

    def _on_engine_death(self, child: ChildProcess) -> None:
        self._mark_dead(f"the engine core process died: {describe_exit(child.exitcode)}")

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
        if self.engine is not None:
            if self.engine.process.is_alive():
                self.engine.process.terminate()
            shutdown_processes([self.engine], timeout=timeout)
        for sock in (self.input_socket, self.output_socket):
            sock.close(linger=0)
        self.ctx.term()


class SyncMPClient(MPClient):
    """For the offline `LLM`: a thread moves decoded outputs into a queue."""

    def __init__(self, config: EngineConfig, shutdown_timeout: float = 0.0):
        super().__init__(config, shutdown_timeout)
        self.outputs: queue.Queue[EngineCoreOutputs | str] = queue.Queue()
        self._utility: dict[int, Future[Any]] = {}
        self._reader = threading.Thread(
            target=self._read_outputs, name="engine-outputs", daemon=True
        )
        self._reader.start()

    def _read_outputs(self) -> None:
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
        self.input_socket.send_multipart(
            self._frames(EngineCoreRequestType.ADD, request), copy=False
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            self.input_socket.send_multipart(self._frames(EngineCoreRequestType.ABORT, request_ids))

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
        self.input_socket.send_multipart(self._utility_frames(call_id, method, args))
        return fut.result(timeout)


class AsyncMPClient(MPClient):
    """For the API server: an asyncio task reads outputs and hands them to `on_outputs`."""

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_dead: Callable[[str], None],
        shutdown_timeout: float = 0.0,
        client_index: int = 0,
    ):
        super().__init__(config, shutdown_timeout, client_index)
        self.on_outputs = on_outputs
        self.on_dead = on_dead
        self.loop: asyncio.AbstractEventLoop | None = None
        self._utility: dict[int, asyncio.Future[Any]] = {}
        self._async_input: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._failed = False

    def start(self) -> None:
        """Start reading outputs; call from inside the running event loop."""
        self.loop = asyncio.get_running_loop()
        self._async_input = zmq.asyncio.Socket.from_socket(self.input_socket)
        self._task = self.loop.create_task(self._read_outputs())

    async def _read_outputs(self) -> None:
        sock = zmq.asyncio.Socket.from_socket(self.output_socket)
        while True:
            frames = await sock.recv_multipart(copy=False)
            if len(frames) == 1 and frames[0].bytes == ENGINE_CORE_DEAD:
                self._fail("the engine core reported a fatal error (see its log)")
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
            self.on_outputs(outputs)

    def _mark_dead(self, reason: str) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._fail, reason)
        elif self.dead_reason is None:
            self.dead_reason = reason

    def _fail(self, reason: str) -> None:
        if self._failed:
            return
        self._failed = True
        self.dead_reason = self.dead_reason or reason
        for fut in self._utility.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._utility.clear()
        self.on_dead(reason)

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        assert self._async_input is not None
        await self._async_input.send_multipart(
            self._frames(EngineCoreRequestType.ADD, request), copy=False
        )

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None and self._async_input is not None:
            await self._async_input.send_multipart(
                self._frames(EngineCoreRequestType.ABORT, request_ids)
            )

    async def call_utility(self, method: str, *args: Any) -> Any:
        self._check_alive()
        assert self.loop is not None and self._async_input is not None
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = self.loop.create_future()
        self._utility[call_id] = fut
        await self._async_input.send_multipart(self._utility_frames(call_id, method, args))
        return await fut

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._task is not None:
            self._task.cancel()
        super().shutdown(timeout)


def _address(sock: zmq.Socket[Any]) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class InprocClient:
    """The engine core in this process (`TREADLE_ENABLE_MULTIPROCESSING=0`): same calls as
    `SyncMPClient`, `get_output` runs steps itself."""

    def __init__(self, config: EngineConfig):
        from treadle.core.engine_core import EngineCore

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
