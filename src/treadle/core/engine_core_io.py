"""The engine core process's two IO threads (ARCHITECTURE §5): socket work and (de)serializing,
which release the GIL and overlap the model step.

- `InputReader` connects a DEALER to every front end (with a fresh random routing identity,
  sending each its ready message first: what the engine found, and its proof of who it is,
  `ipc/engine_auth.py`),
  polls them and the DP coordinator's XSUB, decodes, checks and puts `(type, payload)` on the
  input queue; ABORTs also go on the eager aborts queue.
- `OutputWriter` takes `(client_index, EngineCoreOutputs)` from the output queue, encodes it
  into reused buffers and sends it zero-copy on that client's PUSH; a control message (the
  `ENGINE_CORE_DEAD` message, `ENGINE_CORE_STOPPED`), one list of frames per front end
  (each sealed with its token: `ipc/engine_auth.py`), goes to every front end; `None` ends it.

Neither thread can die silently. A message that cannot be used (malformed, of an unknown
type, naming a client index with no socket, too large to send) is dropped and logged, and the
thread goes on. Anything else that ends a thread is logged with its traceback and reported
through `on_failure`, which makes the engine core die loudly (ENGINE_CORE_DEAD, exit 1).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from treadle.ipc.engine_auth import routing_id
from treadle.ipc.inbound import DropLog, MessageTooLargeError, check_outbound, inbound_options
from treadle.ipc.serial import MsgpackDecoder, MsgpackEncoder
from treadle.ipc.tensor_ring import TensorRingReader, ring_name
from treadle.ipc.zmq_utils import ipc_listening, make_zmq_socket, split_zmq_path
from treadle.logger import init_logger
from treadle.wire.control import COORDINATOR, UtilityRequest
from treadle.wire.engine import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    StartDPWave,
    UtilityOutput,
    add_request_identity,
)

logger = init_logger(__name__)

LINGER_MS = 2000
# tcp peers (engines on another host) check each other with ZMTP heartbeats.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 3000
_RECONNECT_S = 1.0

InputItem = tuple[EngineCoreRequestType, Any]
# (client, outputs) | a control message's frames for each front end | the end
OutputItem = tuple[int, EngineCoreOutputs] | list[list[bytes]] | None


class FrontEndGone(RuntimeError):
    """A front end on another host disconnected: this engine has nobody left to serve."""


class InputReader:
    """The input thread's work; `run` is the thread's target."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        addresses: list[str],
        coordinator_address: str,
        ready_messages: list[bytes],
        input_queue: queue.Queue[InputItem],
        aborts_queue: queue.Queue[list[str]],
        on_failure: Callable[[str], None],
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.ctx = ctx
        self.addresses = addresses
        self.coordinator_address = coordinator_address
        self.ready_messages = ready_messages  # one per front end
        self.stopping = stopping  # asked to stop: the front ends close too, as they should
        self.input_queue = input_queue
        self.aborts_queue = aborts_queue
        self.on_failure = on_failure
        self.ready = threading.Event()  # set once every front end has had the ready message
        self.drops = DropLog(logger)
        self.decoders = {
            # Large tensors may come through the tensor ring of their front end (--tensor-ipc
            # shm), only of these: the rings are named after the front ends' addresses.
            EngineCoreRequestType.ADD: MsgpackDecoder(
                EngineCoreRequest,
                tensor_rings=TensorRingReader(ring_name(a) for a in addresses),
            ),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityRequest),
        }
        self.wave_decoder = MsgpackDecoder(StartDPWave)

    def run(self) -> None:
        try:
            self._serve()
        except Exception as e:
            logger.exception("The engine core's input thread failed")
            self.on_failure(f"the input thread failed: {type(e).__name__}: {e}")
        finally:
            self.ready.set()  # never leave the main thread waiting

    def _serve(self) -> None:
        self.poller = zmq.Poller()
        # monitor socket -> (index of the front end, its DEALER)
        self.monitors: dict[Any, tuple[int, zmq.Socket[Any]]] = {}
        self.reconnect_at: dict[int, float] = {}  # front end index -> when
        sockets = [self._connect(i) for i in range(len(self.addresses))]
        coordinator = None
        if self.coordinator_address:
            coordinator = make_zmq_socket(
                self.ctx, self.coordinator_address, zmq.XSUB, linger=0, options=inbound_options()
            )
            coordinator.send(b"\x01")  # subscribe to everything
            self.poller.register(coordinator, zmq.POLLIN)
        self.ready.set()
        for sock in sockets:
            self.poller.register(sock, zmq.POLLIN)
        while True:
            now = time.monotonic()
            for index, due in list(self.reconnect_at.items()):
                if due <= now:
                    del self.reconnect_at[index]
                    self.poller.register(self._connect(index), zmq.POLLIN)
            wait = min(self.reconnect_at.values(), default=None)
            timeout = None if wait is None else max(0, int((wait - now) * 1000) + 1)
            # Requests before disconnects: the disconnect closes its DEALER, whose last
            # messages (read in the same poll) still count, and are then aborted.
            events = sorted(self.poller.poll(timeout), key=lambda e: e[0] in self.monitors)
            for sock, _ in events:
                if sock in self.monitors:
                    self._on_disconnect(sock)
                elif sock is coordinator:
                    self._on_wave(coordinator.recv_multipart(copy=False))
                else:
                    self._on_request(sock.recv_multipart(copy=False))

    def _connect(self, index: int) -> zmq.Socket[Any]:
        """A DEALER to front end `index` that has sent it the ready message (which binds this
        engine to the connection there), and a monitor of its disconnects (polled)."""
        addr = self.addresses[index]
        options = inbound_options()
        if split_zmq_path(addr)[0] == "tcp":
            options[zmq.HEARTBEAT_IVL] = _HEARTBEAT_IVL_MS
            options[zmq.HEARTBEAT_TIMEOUT] = _HEARTBEAT_TIMEOUT_MS
        sock = make_zmq_socket(
            self.ctx,
            addr,
            zmq.DEALER,
            bind=False,
            identity=routing_id(),
            linger=0,
            options=options,
        )
        sock.send(self.ready_messages[index])
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.monitors[monitor] = (index, sock)
        self.poller.register(monitor, zmq.POLLIN)
        return sock

    def _on_disconnect(self, monitor: Any) -> None:
        """A tcp front end (another host) that disconnects is gone: the engine exits. A
        local one drops us when it dies (an API server killed, which the supervisor starts
        again on the same addresses) or after a protocol error, such as a message over
        TREADLE_ZMQ_MAX_MSG_BYTES, and zmq does not connect again after those: a new DEALER
        does, `_RECONNECT_S` later (with a new routing identity; its ready message binds the
        engine to it again). Either way its requests are aborted (FRONTEND_DROPPED): a dead
        front end's would run on for nobody, and one that is alive hears them end."""
        event = parse_monitor_message(monitor.recv_multipart())
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return
        index, sock = self.monitors[monitor]
        addr = self.addresses[index]
        if split_zmq_path(addr)[0] == "tcp":
            reason = f"the front end at {addr} disconnected; exiting"
            self.input_queue.put((EngineCoreRequestType.FRONTEND_GONE, reason))
            return
        if ipc_listening(addr):
            logger.warning(
                "The connection to the front end at %s dropped while it listens (it sent a "
                "message larger than TREADLE_ZMQ_MAX_MSG_BYTES, or broke the protocol); "
                "connecting again",
                addr,
            )
        else:
            logger.log(
                logging.DEBUG if self.stopping() else logging.WARNING,
                "The connection to the front end at %s dropped: its API server stopped or "
                "died; connecting again (to its successor, if any)",
                addr,
            )
        self.input_queue.put((EngineCoreRequestType.FRONTEND_DROPPED, index))
        for old in (monitor, sock):
            self.poller.unregister(old)
        del self.monitors[monitor]
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        self.reconnect_at[index] = time.monotonic() + _RECONNECT_S

    def _on_wave(self, frames: list[Any]) -> None:
        try:
            wave = self.wave_decoder.decode(frames)
        except Exception as e:
            self.drops.drop("Dropped a malformed coordinator message: %s", e)
            return
        self.input_queue.put((EngineCoreRequestType.START_DP_WAVE, wave))

    def _on_request(self, frames: list[Any]) -> None:
        """`[type byte][msgpack][aux...]`: only ADD, ABORT and UTILITY come from outside."""
        kind: EngineCoreRequestType | None = None
        try:
            kind = EngineCoreRequestType(bytes(frames[0].buffer))
            decoder = self.decoders.get(kind)
            if decoder is None:
                raise ValueError(f"request type {kind.name} is not accepted from a front end")
            payload = decoder.decode(frames[1:])
        except Exception as e:
            size = sum(len(f.buffer) for f in frames)
            self.drops.drop(
                "Dropped a malformed message (%d frames, %d bytes): %s: %s",
                len(frames),
                size,
                type(e).__name__,
                e,
            )
            if kind is EngineCoreRequestType.ADD and len(frames) > 1:
                self._refuse_undecodable(frames[1].buffer, f"{type(e).__name__}: {e}")
            return
        if kind in (EngineCoreRequestType.ADD, EngineCoreRequestType.UTILITY):
            client = payload.client_index
            if not 0 <= client < len(self.addresses):
                what = payload.request_id if kind is EngineCoreRequestType.ADD else payload.method
                self.drops.drop(
                    "Dropped %s %r: client index %d has no socket (%d front ends)",
                    kind.name,
                    what,
                    client,
                    len(self.addresses),
                )
                return
        if kind is EngineCoreRequestType.ABORT:
            self.aborts_queue.put(payload)
        self.input_queue.put((kind, payload))

    def _refuse_undecodable(self, payload: Any, reason: str) -> None:
        """An ADD whose fields did not decode (e.g. out-of-range sampling params) still names
        its request and client: answer it with an error rather than leave its sender waiting."""
        identity = add_request_identity(payload)
        if identity is not None and 0 <= identity[1] < len(self.addresses):
            request_id, client = identity
            self.input_queue.put((EngineCoreRequestType.REFUSE, (request_id, client, reason)))


class OutputWriter:
    """The output thread's work; `run` is the thread's target."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        addresses: list[str],
        coordinator_address: str,
        output_queue: queue.Queue[OutputItem],
        on_failure: Callable[[str], None],
    ) -> None:
        self.ctx = ctx
        self.addresses = addresses
        self.coordinator_address = coordinator_address
        self.output_queue = output_queue
        self.on_failure = on_failure
        self.encoder = MsgpackEncoder()
        self.drops = DropLog(logger)
        self._free: list[bytearray] = []
        self._in_flight: deque[tuple[bytearray, zmq.MessageTracker]] = deque()

    def run(self) -> None:
        sockets = [
            make_zmq_socket(self.ctx, addr, zmq.PUSH, linger=LINGER_MS) for addr in self.addresses
        ]
        coordinator = (
            make_zmq_socket(self.ctx, self.coordinator_address, zmq.PUSH, linger=0)
            if self.coordinator_address
            else None
        )
        try:
            while (item := self.output_queue.get()) is not None:
                if isinstance(item, list):  # ENGINE_CORE_DEAD / STOPPED go to every front end
                    for sock, frames in zip(sockets, item, strict=True):
                        sock.send_multipart(frames)
                    continue
                try:
                    self._send(sockets, coordinator, *item)
                except zmq.ZMQError:
                    raise  # the socket is broken: this engine cannot answer anyone
                except Exception as e:
                    self.drops.drop(
                        "Dropped an output that could not be sent: %s: %s",
                        type(e).__name__,
                        e,
                        exc_info=True,
                    )
        except Exception as e:
            logger.exception("The engine core's output thread failed")
            self.on_failure(f"the output thread failed: {type(e).__name__}: {e}")
        finally:
            for sock in sockets:
                sock.close(linger=LINGER_MS)
            if coordinator is not None:
                coordinator.close(linger=0)

    def _send(
        self,
        sockets: list[zmq.Socket[Any]],
        coordinator: zmq.Socket[Any] | None,
        client: int,
        outputs: EngineCoreOutputs,
    ) -> None:
        if client == COORDINATOR:
            if coordinator is not None:
                coordinator.send(self.encoder.encode(outputs)[0])
            return
        if not 0 <= client < len(sockets):
            self.drops.drop("Dropped outputs for client index %d: it has no socket", client)
            return
        while self._in_flight and self._in_flight[0][1].done:
            self._free.append(self._in_flight.popleft()[0])
        buf = self._free.pop() if self._free else bytearray()
        try:
            frames = self.encoder.encode_into(outputs, buf)
            check_outbound(frames, "an engine output")
        except (TypeError, MessageTooLargeError) as e:
            self._free.append(buf)
            if outputs.utility_output is None:
                raise
            # The caller waits for this answer: it gets the failure instead of the result.
            failure = UtilityOutput(
                outputs.utility_output.call_id,
                failure_message=f"the result cannot be sent: {type(e).__name__}: {e}",
            )
            reply = EngineCoreOutputs(outputs.engine_index, utility_output=failure)
            sockets[client].send_multipart(self.encoder.encode(reply))
            return
        tracker = sockets[client].send_multipart(frames, copy=False, track=True)
        if tracker is None or tracker.done:
            self._free.append(buf)
        else:
            self._in_flight.append((buf, tracker))


def send_to_all(ctx: zmq.Context[Any], addresses: list[str], messages: list[list[bytes]]) -> None:
    """Send a control message (its frames for each front end) to every front end from the
    calling thread (when the output thread is gone and the engine must still say that it
    died)."""
    for addr, frames in zip(addresses, messages, strict=True):
        sock = make_zmq_socket(ctx, addr, zmq.PUSH, linger=LINGER_MS)
        try:
            sock.send_multipart(frames)
        finally:
            sock.close(linger=LINGER_MS)
