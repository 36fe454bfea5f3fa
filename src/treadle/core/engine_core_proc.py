"""`EngineCoreProc`: the engine core process. Wraps `EngineCore` with the IO threads and the
busy loop, and speaks the start-up handshake (ARCHITECTURE §2, §5).

Threads:
- input: polls the DEALER of every front end, decodes, puts `(type, payload)` on
  `input_queue` (ABORTs also on the eager aborts queue that `EngineCore.step` reads between
  the forward pass and the output update). A malformed message is logged and dropped.
- main: the busy loop; blocks on `input_queue` only while there is no work.
- output: encodes `(client_index, EngineCoreOutputs)` into reused buffers, sends zero-copy.

Handshake, on the front end's handshake ROUTER:
    engine --HELLO--> front end --addresses--> engine (loads, sizes KV) --READY--> front end
then the engine's first message on each input DEALER is a ready message (which also registers
its identity with the ROUTER). A fatal error sends the single frame `ENGINE_CORE_DEAD` to every
front end and exits non-zero.

With data parallelism the engine also talks to the DP coordinator: it pushes its stats and its
idle/busy transitions (`start_wave`, `wave_complete`) and subscribes to START_DP_WAVE. An
engine on another host (tcp) exits when its front end disconnects.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from treadle import envs
from treadle.config import EngineConfig
from treadle.core.engine_core import EngineCore
from treadle.ipc.process import ReadyPipe
from treadle.ipc.serial import MsgpackDecoder, MsgpackEncoder
from treadle.ipc.zmq_utils import engine_identity, make_zmq_socket, split_zmq_path
from treadle.logger import init_logger, set_process_name
from treadle.wire.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    SchedulerStats,
    StartDPWave,
    UtilityOutput,
)

logger = init_logger(__name__)

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
_POLL_MS = 1000
_LINGER_MS = 2000
COORDINATOR = -1  # output_queue "client" that means the DP coordinator
_COORDINATOR_STATS_INTERVAL_S = 0.05
# tcp peers (engines on another host) check each other with ZMTP heartbeats.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 3000


class Handshake(msgspec.Struct, omit_defaults=True):
    """Messages on the handshake socket, in both directions."""

    status: str  # HELLO | ADDRESSES | READY
    inputs: list[str] = []
    outputs: list[str] = []
    coordinator_input: str = ""  # XPUB of the DP coordinator (the engine subscribes)
    coordinator_output: str = ""  # PULL of the DP coordinator (the engine pushes)
    num_blocks: int = 0
    max_model_len: int = 0
    vocab_size: int = 0


class UtilityRequest(msgspec.Struct, array_like=True):
    client_index: int
    call_id: int
    method: str
    args: list[Any] = []


class FrontEndGone(RuntimeError):
    """A front end on another host disconnected: this engine has nobody left to serve."""


@dataclass
class _Shutdown:
    requested: bool = False


def run_engine_core(
    ready: ReadyPipe,
    config: EngineConfig,
    handshake_address: str,
    dp_rank: int = 0,
    shutdown_timeout: float = 0.0,
) -> None:
    """Process entry (`treadle.ipc.process.start_process` target)."""
    name = f"EngineCore_DP{dp_rank}"
    set_process_name(name)
    shutdown = _Shutdown()

    def on_signal(signum: int, frame: Any) -> None:
        if shutdown.requested:  # a second signal: stop at once
            raise SystemExit(1)
        shutdown.requested = True
        logger.info("Received %s; shutting down", signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    parallel = config.parallel
    if parallel.local_engine_count > 1 and parallel.world_size == 1:
        # The engines on this host share its cores (a TP worker divides them itself).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.local_engine_count))
    proc = EngineCoreProc(config, handshake_address, dp_rank, shutdown, shutdown_timeout)
    ready.send_ready()
    proc.run()


class EngineCoreProc:
    def __init__(
        self,
        config: EngineConfig,
        handshake_address: str,
        dp_rank: int,
        shutdown: _Shutdown,
        shutdown_timeout: float,
    ) -> None:
        self.dp_rank = dp_rank
        self.identity = engine_identity(dp_rank)
        self.shutdown = shutdown
        self.shutdown_timeout = shutdown_timeout
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[int, EngineCoreOutputs] | bytes | None] = queue.Queue()
        self.aborts_queue: queue.Queue[list[str]] = queue.Queue()
        self._stats_sent: SchedulerStats | None = None
        # Data parallel: the wave this engine knows of, and what the coordinator last heard.
        self.dp = config.parallel.data_parallel_size > 1
        self.current_wave = 0
        self._busy = False
        self._coordinator_sent = 0.0

        hs = make_zmq_socket(
            self.ctx,
            handshake_address,
            zmq.DEALER,
            bind=False,
            identity=self.identity,
            linger=_LINGER_MS,
        )
        encode, decode = msgspec.msgpack.encode, msgspec.msgpack.Decoder(Handshake).decode
        try:
            hs.send(encode(Handshake("HELLO")))
            timeout = envs.engine_ready_timeout_s()
            if not hs.poll(timeout * 1000):
                raise TimeoutError(
                    f"no front end answered at {handshake_address} within {timeout} s "
                    "(TREADLE_ENGINE_READY_TIMEOUT_S)"
                )
            addresses = decode(hs.recv())
            self.engine = EngineCore(config, engine_index=dp_rank)
            self.engine.aborts_queue = self.aborts_queue
            self.engine.executor.failure_callback = self._executor_failed
            info = Handshake(
                "READY",
                num_blocks=self.engine.num_blocks,
                max_model_len=self.engine.max_model_len,
                vocab_size=self.engine.vocab_size,
            )
            hs.send(encode(info))
        finally:
            hs.close()
        self.input_addresses = addresses.inputs
        self.output_addresses = addresses.outputs
        self.coordinator_input = addresses.coordinator_input
        self.coordinator_output = addresses.coordinator_output
        self.ready_message = encode(info)
        self.inputs_ready = threading.Event()
        self.input_thread = threading.Thread(
            target=self._input_loop, name="engine-input", daemon=True
        )
        self.output_thread = threading.Thread(
            target=self._output_loop, name="engine-output", daemon=True
        )

    # -- main thread --------------------------------------------------------------------------

    def run(self) -> None:
        self.output_thread.start()
        self.input_thread.start()
        self.inputs_ready.wait()
        try:
            self._busy_loop()
        except FrontEndGone as e:
            logger.error("%s", e)  # nobody is left to tell
            self.engine.shutdown()
            raise SystemExit(1) from e
        except BaseException as e:
            if not isinstance(e, SystemExit) or e.code not in (0, None):
                logger.exception("Engine core failed; telling the front ends")
                self.output_queue.put(ENGINE_CORE_DEAD)
                self.output_queue.put(None)
                self.output_thread.join(5.0)
                self.engine.shutdown()  # stop the workers, or exiting would wait on them
                raise SystemExit(1) from e
            self.engine.shutdown()
            raise
        self.output_queue.put(None)
        self.output_thread.join(10.0)
        self.engine.shutdown()
        logger.info("Engine core stopped")

    def _busy_loop(self) -> None:
        engine = self.engine
        deadline: float | None = None
        while True:
            if self.shutdown.requested:
                if deadline is None:
                    deadline = time.monotonic() + self.shutdown_timeout
                if not engine.has_unfinished_requests():
                    return
                if time.monotonic() >= deadline:
                    self._abort_all()
                    return
            block = not engine.has_unfinished_requests() and not self.shutdown.requested
            self._drain_inputs(block)
            if self.dp:
                self._tell_coordinator()
            for client, outputs in engine.step().items():
                self.output_queue.put((client, outputs))
                self._stats_sent = outputs.scheduler_stats
            if self.dp:
                self._tell_coordinator()
            if not engine.has_unfinished_requests():
                self._publish_idle_stats()

    def _tell_coordinator(self) -> None:
        """Push idle <-> busy transitions (which start and complete waves) at once, and the
        stats at most every 50 ms while busy."""
        busy = self.engine.has_unfinished_requests()
        now = time.monotonic()
        if busy == self._busy and (
            not busy or now - self._coordinator_sent < _COORDINATOR_STATS_INTERVAL_S
        ):
            return
        out = EngineCoreOutputs(self.dp_rank, scheduler_stats=self.engine.get_stats())
        if busy != self._busy:
            self._busy = busy
            if busy:
                out.start_wave = self.current_wave
            else:
                out.wave_complete = self.current_wave
        self._coordinator_sent = now
        self.output_queue.put((COORDINATOR, out))

    def _publish_idle_stats(self) -> None:
        """Outputs carry the stats while there is work; once idle (e.g. after an abort) the
        front ends still need to see the final counts, once."""
        stats = self.engine.get_stats()
        if stats == self._stats_sent:
            return
        self._stats_sent = stats
        for client in range(len(self.output_addresses)):
            idle = EngineCoreOutputs(self.dp_rank, scheduler_stats=stats, timestamp=time.time())
            self.output_queue.put((client, idle))

    def _drain_inputs(self, block: bool) -> None:
        try:
            item = (
                self.input_queue.get(timeout=_POLL_MS / 1000)
                if block
                else self.input_queue.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if kind is EngineCoreRequestType.ADD:
            req: EngineCoreRequest = payload
            if self.shutdown.requested:
                self._reject(req, "the engine is shutting down")
                return
            self.current_wave = max(self.current_wave, req.current_wave)
            try:
                self.engine.add_request(req)
            except ValueError as e:
                self._reject(req, str(e))
        elif kind is EngineCoreRequestType.START_DP_WAVE:
            wave: StartDPWave = payload
            self.current_wave = max(self.current_wave, wave.wave)
            if wave.exclude != self.dp_rank:
                logger.debug(
                    "START_DP_WAVE: joining wave %d, started by engine %d", wave.wave, wave.exclude
                )
        elif kind is EngineCoreRequestType.ABORT:
            self.engine.abort_requests(payload)
        elif kind is EngineCoreRequestType.UTILITY:
            self._call_utility(payload)
        elif kind is EngineCoreRequestType.EXECUTOR_FAILED:
            raise RuntimeError(f"executor failed: {payload}")
        elif kind is EngineCoreRequestType.WAKEUP:  # the front end is gone
            raise FrontEndGone(payload)

    def _executor_failed(self, reason: str) -> None:
        """Called from the executor's monitor thread: the busy loop raises on it."""
        self.input_queue.put((EngineCoreRequestType.EXECUTOR_FAILED, reason))

    def _reject(self, req: EngineCoreRequest, reason: str) -> None:
        logger.warning("Rejected request %s: %s", req.request_id, reason)
        out = EngineCoreOutput(
            req.request_id, [], finish_reason=FinishReason.ABORT, stop_reason=reason
        )
        self.output_queue.put(
            (req.client_index, EngineCoreOutputs(self.dp_rank, [out], timestamp=time.time()))
        )

    def _call_utility(self, call: UtilityRequest) -> None:
        result = UtilityOutput(call.call_id)
        try:
            if call.method.startswith("_"):
                raise AttributeError(f"no utility method {call.method!r}")
            method = getattr(self.engine, call.method, None)
            if method is None or not callable(method):
                raise AttributeError(f"no utility method {call.method!r}")
            result.result = method(*call.args)
        except Exception as e:
            result.failure_message = f"{type(e).__name__}: {e}"
        outputs = EngineCoreOutputs(self.dp_rank, utility_output=result, timestamp=time.time())
        self.output_queue.put((call.client_index, outputs))

    def _abort_all(self) -> None:
        ids = list(self.engine.scheduler.requests)
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for rid in ids:
            req = self.engine.scheduler.requests[rid]
            by_client.setdefault(req.client_index, []).append(
                EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT, stop_reason="shutdown")
            )
        self.engine.abort_requests(ids)
        for client, outs in by_client.items():
            self.output_queue.put(
                (client, EngineCoreOutputs(self.dp_rank, outs, timestamp=time.time()))
            )

    # -- IO threads ---------------------------------------------------------------------------

    def _input_loop(self) -> None:
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityRequest),
        }
        sockets = [self._input_socket(addr) for addr in self.input_addresses]
        poller = zmq.Poller()
        monitors = {}
        for sock, addr in zip(sockets, self.input_addresses, strict=True):
            if split_zmq_path(addr)[0] == "tcp":  # a front end on another host may vanish
                monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                monitors[monitor] = addr
                poller.register(monitor, zmq.POLLIN)
        for sock in sockets:
            sock.send(self.ready_message)
        coordinator = None
        if self.coordinator_input:
            coordinator = make_zmq_socket(self.ctx, self.coordinator_input, zmq.XSUB, linger=0)
            coordinator.send(b"\x01")  # subscribe to everything
            poller.register(coordinator, zmq.POLLIN)
            wave_decoder = MsgpackDecoder(StartDPWave)
        self.inputs_ready.set()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                if sock in monitors:
                    event = parse_monitor_message(sock.recv_multipart())  # type: ignore[union-attr]
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        reason = f"the front end at {monitors[sock]} disconnected; exiting"
                        self.input_queue.put((EngineCoreRequestType.WAKEUP, reason))
                    continue
                if sock is coordinator:
                    try:
                        wave = wave_decoder.decode([coordinator.recv()])
                    except Exception as e:
                        logger.error("Dropped a malformed coordinator message: %s", e)
                        continue
                    self.input_queue.put((EngineCoreRequestType.START_DP_WAVE, wave))
                    continue
                frames = sock.recv_multipart(copy=False)  # type: ignore[union-attr]
                try:
                    kind = EngineCoreRequestType(bytes(frames[0].buffer))
                    payload = decoders[kind].decode(frames[1:])
                except Exception as e:
                    logger.error("Dropped a malformed message: %s: %s", type(e).__name__, e)
                    continue
                if kind is EngineCoreRequestType.ABORT:
                    self.aborts_queue.put(payload)
                self.input_queue.put((kind, payload))

    def _input_socket(self, addr: str) -> zmq.Socket[Any]:
        options: dict[int, int] = {}
        if split_zmq_path(addr)[0] == "tcp":
            options = {
                zmq.HEARTBEAT_IVL: _HEARTBEAT_IVL_MS,
                zmq.HEARTBEAT_TIMEOUT: _HEARTBEAT_TIMEOUT_MS,
            }
        return make_zmq_socket(
            self.ctx,
            addr,
            zmq.DEALER,
            bind=False,
            identity=self.identity,
            linger=0,
            options=options,
        )

    def _output_loop(self) -> None:
        encoder = MsgpackEncoder()
        sockets = [
            make_zmq_socket(self.ctx, addr, zmq.PUSH, linger=_LINGER_MS)
            for addr in self.output_addresses
        ]
        coordinator = (
            make_zmq_socket(self.ctx, self.coordinator_output, zmq.PUSH, linger=0)
            if self.coordinator_output
            else None
        )
        free: list[bytearray] = []
        in_flight: deque[tuple[bytearray, zmq.MessageTracker]] = deque()
        while True:
            item = self.output_queue.get()
            if item is None:
                break
            if isinstance(item, bytes):  # ENGINE_CORE_DEAD goes to every front end
                for sock in sockets:
                    sock.send(item)
                continue
            client, outputs = item
            if client == COORDINATOR:
                if coordinator is not None:
                    coordinator.send(encoder.encode(outputs)[0])
                continue
            while in_flight and in_flight[0][1].done:
                free.append(in_flight.popleft()[0])
            buf = free.pop() if free else bytearray()
            frames = encoder.encode_into(outputs, buf)
            tracker = sockets[client].send_multipart(frames, copy=False, track=True)
            if tracker is None or tracker.done:
                free.append(buf)
            else:
                in_flight.append((buf, tracker))
        for sock in sockets:
            sock.close(linger=_LINGER_MS)
        if coordinator is not None:
            coordinator.close(linger=0)
