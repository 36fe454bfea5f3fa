"""The API server's engine client: `MPClient` read and written from asyncio tasks, with engine
restarts (`engine_restarts.py`) and the DP coordinator's restarts.

Tasks: the output reader (hands outputs to `on_outputs`), the ROUTER drain (a restarted
engine's first message arrives there), the DP coordinator reader, the stall watch, and a
watch of peers leaving each socket. A task that fails is logged with its traceback and ends
the client (`on_dead`): nothing is left waiting on a reader that is gone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from treadle import envs
from treadle.config import EngineConfig
from treadle.core.engine_core_proc import ENGINE_CORE_DEAD, ENGINE_CORE_STOPPED
from treadle.frontend.core_client import (
    AttachTo,
    EngineDeadError,
    MPClient,
    settle_utility,
)
from treadle.frontend.engine_restarts import EngineRestarts, process_of, running
from treadle.frontend.inflight import InFlight
from treadle.ipc.process import ChildProcess, chain_signal_handlers, describe_exit, signal_children
from treadle.logger import init_logger
from treadle.wire.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType

logger = init_logger(__name__)

# How long an engine may take to answer when a peer left the request socket (a step of a long
# prefill must fit), or to say hello after a restart: one that does not is dead.
ENGINE_PING_TIMEOUT_S = 10.0
# An engine process's exit explains a disconnect seen this long after it.
_EXIT_EXPLAINS_S = 5.0


class AsyncMPClient(MPClient):
    """For the API server. `on_outputs(outputs)` gets every engine's outputs (in the event
    loop); `on_dead(reason)` runs once when the engines are gone for good (a failure: every
    request fails, /health 503, exit 1); `on_stopped(reason)` when an engine was stopped on
    purpose (by default it sends this process SIGTERM, which stops the API server as a
    signal to it would); `on_event(kind, engine, count)` counts restarts, resumed and
    poisoned requests."""

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
        self.on_event: Callable[[str, int, int], None] = lambda kind, engine, count: None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._utility: dict[int, asyncio.Future[Any]] = {}
        self._utility_engine: dict[int, int] = {}  # call id -> engine
        self._async_input: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ended = False  # dead or stopped: told once
        self._pending_end: tuple[str, bool] | None = None
        self._monitors: list[tuple[zmq.Socket[Any], zmq.Socket[Any]]] = []  # (socket, monitor)
        self._restore_signals: Callable[[], None] = lambda: None
        self._attached = attach is not None
        # A peer that leaves the request socket may be a dead engine (ping them all) where
        # nobody restarts engines: remote ones, or a supervisor's with restarts off.
        p = config.parallel
        self.multi_node = p.multi_node
        self.local_ranks = range(
            p.data_parallel_start_rank, p.data_parallel_start_rank + p.local_engine_count
        )
        self._watch_disconnects = self.multi_node or (
            attach is not None and config.restart.max_engine_restarts == 0
        )
        self._supervisor = os.getppid() if attach is not None else None  # started us
        self._awaiting_hello: dict[int, asyncio.Future[None]] = {}  # rank -> its restart's
        # (when, what) of this host's engine processes that exited: explains a disconnect
        self._exits: collections.deque[tuple[float, str]] = collections.deque(maxlen=16)
        self.inflight = InFlight()
        self.restarts = EngineRestarts(
            self,
            config.parallel.data_parallel_size,
            config.restart,
            max_waiting=4 * config.scheduler.max_num_seqs,
        )
        super().__init__(config, shutdown_timeout, client_index, attach)

    def start(self) -> None:
        """Start reading outputs; call from inside the running event loop."""
        self.loop = asyncio.get_running_loop()
        assert self.input_socket is not None
        self._async_input = zmq.asyncio.Socket.from_socket(self.input_socket)
        self.spawn(self._read_outputs(), "engine output reader")
        self.spawn(self._drain_requests(self._async_input), "request socket reader")
        if self.coordinator_socket is not None:
            self.spawn(self._read_coordinator(), "DP coordinator reader")
        self.spawn(self.restarts.watch_stalls(), "engine stall watch")
        if self.follows_restarts:
            watch = self.restarts.watch_processes(self.engine_pids, self.local_ranks)
            self.spawn(watch, "engine process watch")
        assert self.output_socket is not None
        for sock, name in ((self.input_socket, "request"), (self.output_socket, "output")):
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitors.append((sock, monitor))
            self.spawn(self._watch_peers(monitor, name), f"{name} socket watch")
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

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """Run a callback the process monitor scheduled; one that raises ends the client (an
        engine must not stay `restarting` with nobody restarting it)."""
        try:
            fn(*args)
        except Exception as e:
            logger.exception("Handling a child's death failed")
            self.fail(f"handling a child's death failed: {type(e).__name__}: {e}")

    def spawn(self, coro: Coroutine[Any, Any, None], what: str) -> None:
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
            self.fail(f"the front end's {what} failed: {type(e).__name__}: {e}")

    # -- the tasks ------------------------------------------------------------------------

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
                self.fail("an engine core reported a fatal error (see its log)")
                return
            if item == ENGINE_CORE_STOPPED:
                self._end("an engine core was stopped", stopped=True)
                continue  # other engines may still finish their requests
            assert isinstance(item, EngineCoreOutputs)
            if self.engine_states[item.engine_index] == "lost":
                continue  # (it went silent, yet runs: its requests run elsewhere now)
            if item.utility_output is not None:
                self._utility_engine.pop(item.utility_output.call_id, None)
                settle_utility(self._utility, item.utility_output)
                continue
            self.router.note_finished(item)
            progressed = self.inflight.on_outputs(item)
            self.on_outputs(item)
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
            if not new:
                logger.info("EngineCore_DP%d connected to the request socket again", rank)
                continue
            awaited = self._awaiting_hello.get(rank)
            if awaited is not None and not awaited.done():
                awaited.set_result(None)
            elif self.follows_restarts:
                # our supervisor restarted this engine: its old process is gone
                if self.restarts.states[rank] != "restarting":  # not seen by the process watch
                    self.restarts.down(rank, f"EngineCore_DP{rank} was restarted (it died)")
                self.engine_pids[rank] = hello.pid
                await self.restarts.back(rank, "(restarted by the supervisor)")

    async def _read_coordinator(self) -> None:
        assert self.coordinator_socket is not None
        sock = zmq.asyncio.Socket.from_socket(self.coordinator_socket)
        while True:
            self._on_dp_stats(await sock.recv())

    async def _watch_peers(self, monitor: zmq.Socket[Any], name: str) -> None:
        """Log each peer that leaves the socket `name`, with what explains it (an engine
        process that exited, and how; an engine that does not answer), or else the hint that
        libzmq drops a peer that sends more than TREADLE_ZMQ_MAX_MSG_BYTES. When engines run on another host (or nobody
        restarts them), a peer leaving the request socket may be an engine whose process or
        host is gone: each such engine must then answer a call within ENGINE_PING_TIMEOUT_S
        (a bare disconnect would let any local process that connects and leaves kill the
        server). A silent one is lost, and the others serve on, when restarts are on and some
        are left; otherwise the client ends."""
        sock = zmq.asyncio.Socket.from_socket(monitor)
        while True:
            event = parse_monitor_message(await sock.recv_multipart())
            if event["event"] != zmq.EVENT_DISCONNECTED or self._ended:
                continue
            silent: list[int] = []
            if name == "request" and self._watch_disconnects:
                silent = await self._silent_engines()
                left = sum(state != "lost" for state in self.engine_states) - len(silent)
                if silent and (left == 0 or not self.follows_remote):
                    self.fail(f"engine core(s) {silent} disconnected and do not answer")
                    return
                if silent:  # the others serve on
                    await self.restarts.lost(silent)
            exits = await self._engine_exits()
            if silent:
                exits.append(f"engine core(s) {silent} do not answer (lost)")
            if exits:
                logger.warning("A peer of the %s socket disconnected: %s", name, "; ".join(exits))
            else:  # nothing else explains it
                logger.warning(
                    "A peer of the %s socket disconnected (it closed, or sent a message "
                    "larger than TREADLE_ZMQ_MAX_MSG_BYTES=%d)",
                    name,
                    envs.zmq_max_msg_bytes(),
                )

    async def _engine_exits(self) -> list[str]:
        """What explains a peer leaving: engine processes of this host that exited lately
        (ours with their exit codes; a supervisor's by pid), looked for during a moment (a
        process's sockets close just before its exit shows)."""
        for _ in range(5):
            now = time.monotonic()
            found = {what for when, what in self._exits if now - when < _EXIT_EXPLAINS_S}
            if self.launcher is not None:
                for child in self.launcher.engines:
                    code = child.exitcode  # once: a restart may swap the process meanwhile
                    if code is not None:
                        found.add(f"{child.describe()} exited: {describe_exit(code)}")
            else:
                for rank in self.local_ranks:
                    pid = self.engine_pids[rank]
                    if pid and not running(process_of(pid)):
                        found.add(f"EngineCore_DP{rank} (pid {pid}) exited")
            if found:
                return sorted(found)
            await asyncio.sleep(0.1)
        return []

    async def _silent_engines(self) -> list[int]:
        async def answers(engine: int) -> bool:
            try:
                await asyncio.wait_for(self.call_utility("get_stats", engine=engine), timeout)
                return True
            except (TimeoutError, EngineDeadError):
                return False

        timeout = ENGINE_PING_TIMEOUT_S
        # With restarts on, this host's engines are watched as processes (and restarted).
        ours = self.local_ranks if self.restart_config.max_engine_restarts > 0 else range(0)
        ranks = [
            e
            for e, state in enumerate(self.engine_states)
            if state in ("up", "resuming") and e not in ours
        ]
        replies = await asyncio.gather(*(answers(e) for e in ranks))
        return [e for e, ok in zip(ranks, replies, strict=True) if not ok]

    # -- the end --------------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        return self._ended or self._closed

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

    def fail(self, reason: str) -> None:
        self._end(reason, stopped=False)

    def _end(self, reason: str, stopped: bool) -> None:
        """No more work: fail pending utility calls, then `on_dead` or `on_stopped`."""
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
            self.on_stopped(reason)
        else:
            self.on_dead(reason)

    # -- requests and calls ---------------------------------------------------------------

    async def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        """Send a request to its engine; while that engine restarts, wait (at most
        4 x max_num_seqs requests wait; more get `EngineDeadError`, a 503)."""
        self._check_alive()
        rank = self.router.route(request, data_parallel_rank)
        while not self.restarts.is_up(rank):  # (it may die again before this one wakes)
            try:
                await self.restarts.wait_up(rank)
            except OverflowError as e:
                self.router.owners([request.request_id])
                raise EngineDeadError(str(e)) from None
            except asyncio.CancelledError:  # its client left while it waited
                self.router.owners([request.request_id])
                raise
        if self.dead_reason is not None or self.engine_states[rank] == "lost":
            self.router.owners([request.request_id])
            why = self.dead_reason or f"engine core {rank} is lost (disconnected, no answer)"
            raise EngineDeadError(why)
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
        if not self.restarts.is_up(engine) or self.engine_states[engine] == "lost":
            raise EngineDeadError(f"engine core {engine} is {self.engine_states[engine]}")
        call_id = next(self._call_ids)
        frames = self._utility_frames(engine, call_id, method, args)
        fut: asyncio.Future[Any] = self.loop.create_future()
        self._utility[call_id] = fut
        self._utility_engine[call_id] = engine
        await self._async_input.send_multipart(frames)
        return await fut

    def fail_calls(self, rank: int, cause: str) -> None:
        for call_id, engine in list(self._utility_engine.items()):
            if engine == rank:
                del self._utility_engine[call_id]
                fut = self._utility.pop(call_id, None)
                if fut is not None and not fut.done():
                    fut.set_exception(EngineDeadError(cause))

    # -- engine and coordinator restarts (issue 14) ---------------------------------------

    @property
    def can_restart(self) -> bool:
        """This client started its engines (so it can start them again) and may."""
        return self.launcher is not None and self.restart_config.max_engine_restarts > 0

    @property
    def follows_restarts(self) -> bool:
        """The `treadle serve` supervisor started these engines and restarts them; this
        client resumes its requests when a restarted one says hello."""
        return self._attached and self.restart_config.max_engine_restarts > 0

    @property
    def follows_remote(self) -> bool:
        """Engines on other hosts that go silent are lost, and the others serve on (restarts
        on): nobody here can start them again."""
        return self.multi_node and self.restart_config.max_engine_restarts > 0

    @property
    def engine_states(self) -> list[str]:
        return self.restarts.states

    def readiness(self) -> str | None:
        """None when every engine is up, resumed what it had, and makes progress; else why
        not (for /health/ready)."""
        return self.dead_reason or self.restarts.readiness()

    def _on_child_death(self, child: ChildProcess) -> None:
        """(The process monitor's thread.) A dead engine core or DP coordinator of ours is
        restarted; one that exited 0 was stopped on purpose."""
        self._exits.append(
            (time.monotonic(), f"{child.describe()} exited: {describe_exit(child.exitcode)}")
        )
        launcher, loop = self.launcher, self.loop
        if child.exitcode != 0 and self.can_restart and launcher is not None and loop is not None:
            cause = f"the {child.name} process died: {describe_exit(child.exitcode)}"
            if child is launcher.coordinator:
                loop.call_soon_threadsafe(self._guarded, self.restarts.coordinator_died, cause)
                return
            for i, engine in enumerate(launcher.engines):
                if engine is child:
                    rank = launcher.start_rank + i
                    loop.call_soon_threadsafe(self._guarded, self.restarts.died, rank, cause)
                    return
        super()._on_child_death(child)

    async def respawn(self, rank: int) -> None:
        assert self.launcher is not None and self.monitor is not None and self.loop is not None
        hello: asyncio.Future[None] = self.loop.create_future()
        self._awaiting_hello[rank] = hello
        try:
            child = await asyncio.to_thread(
                self.launcher.restart_engine,
                rank,
                self.ctx,
                [self.addresses[0]],
                [self.addresses[1]],
                [self.key],
            )
            self.monitor.add(child)
            self.engine_pids[rank] = child.process.pid or 0
            await asyncio.wait_for(hello, ENGINE_PING_TIMEOUT_S)
        finally:
            self._awaiting_hello.pop(rank, None)

    def can_kill(self, rank: int) -> bool:
        """Our own engine, or (API server 0 of a supervisor) one of the supervisor's on this
        host, which the supervisor then restarts."""
        if rank not in self.local_ranks:
            return False
        if self.can_restart:
            return True
        return self.follows_restarts and self.client_index == 0 and self.engine_pids[rank] > 0

    def kill(self, rank: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.launcher is not None:
                self.launcher.engines[rank - self.launcher.start_rank].process.kill()
            else:
                os.kill(self.engine_pids[rank], signal.SIGKILL)

    async def respawn_coordinator(self) -> None:
        assert self.launcher is not None and self.monitor is not None
        self.monitor.add(await asyncio.to_thread(self.launcher.restart_coordinator))

    def shutdown(self, timeout: float = 5.0) -> None:
        for task in self._tasks:
            task.cancel()
        self._restore_signals()
        if not self._closed:  # the context's term() waits for every socket, monitors too
            for sock, monitor in self._monitors:
                sock.disable_monitor()
                monitor.close(linger=0)
        super().shutdown(timeout)


def _stop_this_process(reason: str) -> None:
    """The default `on_stopped`: stop this process as SIGTERM does (uvicorn shuts down
    gracefully and the CLI exits 0)."""
    os.kill(os.getpid(), signal.SIGTERM)
