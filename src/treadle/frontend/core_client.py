"""Engine-core clients: the front end's side of channels 1 and 2 and of the handshake.

`MPClient` starts the engine core process(es) (`launcher.py`), binds a ROUTER (requests) and a
PULL (outputs), runs the handshake, and watches the processes; with DP it routes each request
to one engine (`engine_router.py`) and follows the DP coordinator's load snapshots. Two
clients build on it: `SyncMPClient` (`sync_client.py`, the offline `LLM`: a thread reads the
outputs into a queue) and `AsyncMPClient` (`async_client.py`, the API server: asyncio tasks,
and engine restarts). `InprocClient` (`sync_client.py`) runs an `EngineCore` in this process.

Engine death, seen as the in-band `ENGINE_CORE_DEAD` frame, the process sentinel or a reader
that fails (logged with its traceback), fails every pending output wait and utility call with
`EngineDeadError`, unless the engine is restarted (`engine_restarts.py`; the detectors are in
`engine_watch.py`). An engine stopped on purpose (the frame `ENGINE_CORE_STOPPED`, or exit
code 0) answered every request first: the client refuses new work (`EngineDeadError`, so
`/health` is 503), and the API server stops cleanly (`ClientListener.on_stopped`). What
arrives on the PULL is checked by `OutputReader`. On the ROUTER, engines send only their first message (per
connection), which binds their rank to the connection if it carries this front end's token
(`ipc/engine_auth.py`; there is no ROUTER_HANDOVER, so no other peer can take an engine's
place); anything else is read and dropped, so unread input cannot pile up, and a refused claim
is logged.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import secrets
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from treadle import envs
from treadle.config import EngineConfig
from treadle.frontend.engine_router import EngineRouter
from treadle.frontend.launcher import EngineLauncher, front_end_host
from treadle.frontend.output_reader import OutputReader
from treadle.frontend.startup import StartupProgress
from treadle.ipc.engine_auth import EngineIdentities, EngineRefusedError, new_key
from treadle.ipc.inbound import DropLog, check_outbound, inbound_options
from treadle.ipc.process import ChildProcess, ProcessMonitor, describe_exit
from treadle.ipc.serial import MsgpackEncoder
from treadle.ipc.tensor_ring import TensorRingWriter, ring_name
from treadle.ipc.zmq_utils import (
    get_bound_address,
    get_open_zmq_ipc_path,
    get_tcp_uri,
    make_zmq_socket,
)
from treadle.logger import init_logger
from treadle.wire.control import Handshake, UtilityRequest
from treadle.wire.engine import EngineCoreRequest, EngineCoreRequestType, UtilityOutput

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


class RequestKilledEngineError(RuntimeError):
    """The request was in flight at two engine core deaths in a row and is not resumed again
    (the dead-letter rule, `inflight.py`): a server error (500), though it may be what kills
    the engine."""

    def __init__(
        self,
        message: str = (
            "the engine core died twice while running this request; it is not resumed again "
            "(it may be what kills the engine)"
        ),
    ) -> None:
        super().__init__(message)

    @classmethod
    def of(cls, cause: str) -> RequestKilledEngineError:
        """The error, saying how the engine died the second time."""
        return cls(f"{cls()}; the second time: {cause}")


@dataclass(frozen=True)
class EngineInfo:
    """What the engine found at start-up (returned, never written into the config)."""

    num_blocks: int
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class AttachTo:
    """For an API server whose engines were started by another process (the `treadle serve`
    supervisor): `report([router, pull, key])` hands this client's ROUTER and PULL addresses
    and its engine key (hex, `ipc/engine_auth.py`) to the process that runs the handshake,
    over a private channel (the ready pipe); `coordinator` is the DP coordinator's XPUB, if
    any. `reuse`: what a dead API server of the same client index reported, for the one that
    replaces it: it binds the same ipc addresses with the same key, the engines connect to it
    again as they would after a dropped connection (no handshake), and it reports once they
    have. `supervisor`: where the supervisor publishes its engine events."""

    report: Callable[[list[str]], None]
    coordinator: str | None = None
    reuse: list[str] | None = None
    supervisor: str | None = None  # where to bind the SUB of its engine events (`engine_events.py`)


class MPClient:
    """The front end's side of channels 1 and 2, to one or several (DP) engine cores.

    Without `attach`, this client starts the engines (and the DP coordinator) itself, runs the
    handshake and watches them. Each ADD goes to the engine that `EngineRouter` picks; an
    ABORT only to the engine that owns the request.
    """

    keep_handshake = False  # keep the handshake socket open (`launcher.desk`) after start-up
    progress: StartupProgress | None = None  # told how far the engines' start-up got

    def __init__(
        self,
        config: EngineConfig,
        shutdown_timeout: float = 0.0,
        client_index: int = 0,
        attach: AttachTo | None = None,
    ):
        p = config.parallel
        self.client_index = client_index
        self.restart_config = config.restart
        self.num_engines = p.data_parallel_size
        reuse = attach.reuse if attach is not None else None
        self.key = bytes.fromhex(reuse[2]) if reuse else new_key()
        self.engines = EngineIdentities(self.key, self.num_engines)
        self.encoder = MsgpackEncoder()
        self.request_drops = DropLog(logger)  # what arrives on the ROUTER after start-up
        self.refusals = DropLog(logger)  # peers that claimed to be an engine core, refused
        self.dead_reason: str | None = None
        # From a random start: the successor of a dead API server (on its sockets) may get
        # the dead one's last answers, which must not settle calls of its own.
        self._call_ids = itertools.count(secrets.randbits(40))
        self._closed = False
        self.monitor: ProcessMonitor | None = None
        self.launcher: EngineLauncher | None = None
        self.input_socket: zmq.Socket[Any] | None = None
        self.output_socket: zmq.Socket[Any] | None = None
        self.coordinator_socket: zmq.Socket[Any] | None = None
        self.tensor_ring: TensorRingWriter | None = None
        self.router = EngineRouter(self.num_engines)
        self.engine_pids = [0] * self.num_engines  # as each engine said (0: not known)
        if attach is None:
            # Start the engines before this process makes its zmq context: the context's IO
            # threads would make forking unsafe. DEALERs that connect early are retried by zmq.
            self.launcher = EngineLauncher(config, shutdown_timeout, progress=self.progress)
            _live_clients.add(self)
        self.ctx: zmq.Context[Any] = zmq.Context()
        try:
            host = front_end_host(config)

            def address() -> str:
                return get_tcp_uri(host, 0) if host else get_open_zmq_ipc_path()

            limits = inbound_options()
            router, pull = reuse[:2] if reuse else (address(), address())
            self.input_socket = make_zmq_socket(
                self.ctx, router, zmq.ROUTER, linger=0, options=limits
            )
            self.output_socket = make_zmq_socket(self.ctx, pull, zmq.PULL, linger=0, options=limits)
            mine = [get_bound_address(self.input_socket), get_bound_address(self.output_socket)]
            self.addresses = mine
            if config.model.tensor_ipc == "shm":
                self.tensor_ring = _make_tensor_ring(mine[0], host)
                self.encoder.tensor_ring = self.tensor_ring
            if self.launcher is not None:
                self.launcher.handshake(
                    self.ctx, [mine[0]], [mine[1]], [self.key], keep=self.keep_handshake
                )
                coordinator = self.launcher.coordinator_addresses(1.0)
                coordinator_address = coordinator.front_publish if coordinator else None
            else:
                assert attach is not None
                if not reuse:  # (the supervisor runs the handshake with it)
                    attach.report([*mine, self.key.hex()])
                coordinator_address = attach.coordinator
            self.info = self._wait_for_engines()
            if attach is not None and reuse:  # a replacement is ready once its engines are
                attach.report([*mine, self.key.hex()])
            self.reader = OutputReader(self.engines, self.info.vocab_size)
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
        """Wait for each engine's first message on the ROUTER (which binds its rank to its
        connection); it carries what the engine found at start-up."""
        assert self.input_socket is not None
        timeout = envs.engine_ready_timeout_s()
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        if self.launcher is not None:
            self.launcher.watch(poller)
        infos: dict[int, Handshake] = {}
        while len(infos) < self.num_engines:
            if self.progress is not None and self.progress.stopping:
                raise RuntimeError("stopped while waiting for the engine cores")
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
                admitted = self._admit(self.input_socket.recv_multipart())
                if admitted is not None:
                    infos[admitted[0]] = admitted[2]
        self.engine_pids = [infos[rank].pid for rank in range(self.num_engines)]
        return EngineInfo(
            num_blocks=min(i.num_blocks for i in infos.values()),
            max_model_len=min(i.max_model_len for i in infos.values()),
            vocab_size=infos[0].vocab_size,
        )

    def _admit(self, frames: list[Any]) -> tuple[int, bool, Handshake] | None:
        """A message on the ROUTER: an engine's first one on a connection binds its rank to
        that connection when it proves who it is; returns (rank, whether it is a new launch
        of that engine, its message). Anything else is dropped (and a refused claim logged,
        rate-limited): requests keep going to the engine bound before."""
        raw = [f.bytes if isinstance(f, zmq.Frame) else bytes(f) for f in frames]
        if len(raw) != 2:
            self._on_stray_request_message(raw)
            return None
        routing, payload = raw
        try:
            hello = _decode_hello(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._on_stray_request_message(raw)
            return None
        try:
            new = self.engines.admit(routing, hello.rank, hello.launch, hello.token)
        except EngineRefusedError as e:
            self.refusals.drop(
                "Refused a peer of the request socket that claims to be an engine core: %s "
                "(not an engine this front end's launcher started?); the engines keep their "
                "connections",
                e,
            )
            return None
        return hello.rank, new, hello

    # -- requests ------------------------------------------------------------------------------

    def _route(self, request: EngineCoreRequest, rank: int | None) -> bytes:
        return self.engines.identity(self.router.route(request, rank))

    def _abort_frames(self, request_ids: list[str]) -> list[list[Any]]:
        return [
            self._frames(self.engines.identity(rank), EngineCoreRequestType.ABORT, ids)
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
        return self._frames(self.engines.identity(engine), EngineCoreRequestType.UTILITY, call)

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
        if self.tensor_ring is not None:  # (the engines have stopped: nobody reads it now)
            self.encoder.tensor_ring = None
            self.tensor_ring.close()


_decode_hello = msgspec.msgpack.Decoder(Handshake).decode


def _make_tensor_ring(router_address: str, host: str | None) -> TensorRingWriter | None:
    """This front end's tensor ring (--tensor-ipc shm), named after its request ROUTER, or
    None (with a warning: tensors then go directly) where it cannot serve."""
    if host is not None:
        logger.warning("--tensor-ipc shm: engines may run on other hosts; sending tensors directly")
        return None
    try:
        return TensorRingWriter(ring_name(router_address), envs.tensor_ipc_shm_mb() << 20)
    except (OSError, RuntimeError) as e:
        logger.warning("--tensor-ipc shm: no tensor ring (%s); sending tensors directly", e)
        return None


def settle_utility(
    pending: dict[int, Future[Any]] | dict[int, asyncio.Future[Any]], u: UtilityOutput
) -> None:
    """Hand a utility call's answer to whoever waits for it (a thread's or a task's future)."""
    fut = pending.pop(u.call_id, None)
    if fut is None or fut.done():
        return
    if u.failure_message is not None:
        fut.set_exception(RuntimeError(u.failure_message))
    else:
        fut.set_result(u.result)
