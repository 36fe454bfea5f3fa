"""`EngineCoreProc`: the engine core process. Wraps `EngineCore` with the IO threads
(`engine_core_io.py`) and the busy loop, and speaks the start-up handshake (ARCHITECTURE §2, §5).

- input thread: decodes and checks what the front ends send, onto `input_queue` (ABORTs
  also onto the eager aborts queue that `EngineCore.step` reads between the forward pass and
  the output update). A malformed message is logged and dropped.
- main: the busy loop; blocks on `input_queue` only while there is no work.
- output thread: encodes `(client_index, EngineCoreOutputs)` into reused buffers, sends them
  zero-copy.

Handshake, on the front end's handshake ROUTER: `engine_handshake.join_front_end` (HELLO,
ADDRESSES, PHASE while the engine loads, READY); then the engine's first message on each input
DEALER (a fresh random routing identity) is a ready message with that front end's token, which
binds the engine's rank to the connection there (`ipc/engine_auth.py`).

Ends (both messages sealed with this launch's proof for each front end, `ipc/engine_auth.py`):
- Stopped: asked (SIGUSR1, `engine_stop.py`: from a front end, the supervisor, or a worker
  that was asked to stop), it lets running requests finish (`--shutdown-timeout`) and answers
  new ADDs with ABORT; a second SIGTERM/SIGINT aborts them now; a third exits at once. A
  signal while the model loads exits at once (nothing runs yet); a worker that exits 0 stops
  it too. Every running request gets its final (aborted) output, then every front end gets
  `ENGINE_CORE_STOPPED`; the process logs a clean shutdown and exits 0.
- Failed: any other error (the executor, a worker dying, an IO thread, a SIGTERM/SIGINT that
  no front end asked for) is logged; every front end gets `ENGINE_CORE_DEAD` with a
  `DeathReport` (the error, its last frames, the last lines logged here); exit 1.

A local front end whose connection drops (an API server killed -9, which the supervisor
starts again on the same sockets) has its requests aborted here, and is connected to again.

With data parallelism the engine also talks to the DP coordinator: it pushes its stats and its
idle/busy transitions (`start_wave`, `wave_complete`) and subscribes to START_DP_WAVE. An
engine on another host (tcp) exits when its front end disconnects.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from treadle.config import EngineConfig
from treadle.core.engine_core import EngineCore
from treadle.core.engine_core_io import (
    FrontEndGone,
    InputItem,
    InputReader,
    OutputItem,
    OutputWriter,
    send_to_all,
)
from treadle.core.engine_handshake import join_front_end
from treadle.core.engine_stop import RELEASE, Shutdown, StoppedUnasked
from treadle.core.engine_waves import EngineWaves
from treadle.executor.base import ExecutorStoppedError
from treadle.ipc.engine_auth import seal_control
from treadle.ipc.fast_exit import exit_now
from treadle.ipc.process import ReadyPipe, at_parent_death, freeze_startup_heap
from treadle.ipc.tensor_ring import remove_orphaned_rings
from treadle.ipc.zmq_utils import remove_ipc_files
from treadle.logger import LogTail, init_logger, set_process_name
from treadle.wire.control import (
    COORDINATOR,
    ENGINE_CORE_DEAD,
    ENGINE_CORE_STOPPED,
    MAX_LOG_LINES,
    DeathReport,
    Handshake,
    StartupPhase,
    UtilityRequest,
)
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
from treadle.wire.topology import EngineChannels
from treadle.worker.cpu_share import mark_engine_process

__all__ = ["EngineCoreProc", "run_engine_core"]

logger = init_logger(__name__)

_POLL_MS = 1000


def run_engine_core(
    ready: ReadyPipe,
    config: EngineConfig,
    handshake_address: str,
    dp_rank: int = 0,
    shutdown_timeout: float = 0.0,
    secret: bytes = b"",
) -> None:
    """Process entry (`treadle.ipc.process.start_process` target); `secret` is what the
    launcher gave this launch, to show in the handshake."""
    name = f"EngineCore_DP{dp_rank}"
    set_process_name(name)
    shutdown = Shutdown()
    running: list[EngineCoreProc] = []

    def on_signal(signum: int, frame: Any) -> None:
        shutdown.on_signal(signum, frame, logger)
        if running:
            running[0].wake()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, on_signal)
    mark_engine_process()  # with one rank, the runner built here sets the model's threads
    tail = LogTail.attach(MAX_LOG_LINES)  # what a death report quotes (the loading's lines too)
    proc = EngineCoreProc(
        config, handshake_address, dp_rank, shutdown, shutdown_timeout, secret, tail
    )
    running.append(proc)
    ready.send_ready()
    proc.run()
    exit_now(0)  # a clean stop: the interpreter's teardown (torch's) would only cost seconds


class EngineCoreProc:
    def __init__(
        self,
        config: EngineConfig,
        handshake_address: str,
        dp_rank: int,
        shutdown: Shutdown,
        shutdown_timeout: float,
        secret: bytes = b"",
        log_tail: LogTail | None = None,
    ) -> None:
        self.dp_rank = dp_rank
        self.log_tail = log_tail
        self.shutdown = shutdown
        self.shutdown_timeout = shutdown_timeout
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.input_queue: queue.Queue[InputItem] = queue.Queue()
        self.output_queue: queue.Queue[OutputItem] = queue.Queue()
        self.aborts_queue: queue.Queue[list[str]] = queue.Queue()
        self._stats_sent: SchedulerStats | None = None
        self.dp = config.parallel.data_parallel_size > 1
        self.waves = EngineWaves(dp_rank)  # (data parallel: what the coordinator hears)

        def load(addresses: Handshake, say: Callable[[StartupPhase], None]) -> EngineCore:
            self.engine = EngineCore(
                config,
                engine_index=dp_rank,
                aborts_queue=self.aborts_queue,
                on_executor_failure=self._executor_failed,
                channels=EngineChannels(
                    inputs=addresses.inputs,
                    outputs=addresses.outputs,
                    coordinator_input=addresses.coordinator_input,
                    coordinator_output=addresses.coordinator_output,
                ),
                on_phase=say,
            )
            self.engine.prompt_files.on_launch(dp_rank, addresses.launch)
            return self.engine

        addresses, ready_messages = join_front_end(
            self.ctx, handshake_address, dp_rank, secret, load
        )
        self.output_addresses = addresses.outputs
        # Control messages carry this launch's proof to each front end (`ipc/engine_auth.py`)
        self.seal = lambda frames: seal_control(addresses.tokens, dp_rank, addresses.launch, frames)
        # A front end killed -9 leaves its ROUTER's and PULL's socket files (and its handshake
        # socket's, kept open while it serves); if it was this process's parent (one API
        # server), this engine removes them as it goes too.
        at_parent_death(
            lambda: remove_ipc_files([handshake_address, *addresses.inputs, *addresses.outputs])
        )
        # And its tensor ring (--tensor-ipc shm), if it made one.
        at_parent_death(lambda: remove_orphaned_rings(addresses.inputs))
        self.reader = InputReader(
            self.ctx,
            addresses.inputs,
            addresses.coordinator_input,
            ready_messages,
            self.input_queue,
            self.aborts_queue,
            self._io_failed,
            stopping=lambda: self.shutdown.requested,
        )
        self.writer = OutputWriter(
            self.ctx,
            addresses.outputs,
            addresses.coordinator_output,
            self.output_queue,
            self._io_failed,
        )
        self.input_thread = threading.Thread(
            target=self.reader.run, name="engine-input", daemon=True
        )
        self.output_thread = threading.Thread(
            target=self.writer.run, name="engine-output", daemon=True
        )

    # -- main thread --------------------------------------------------------------------------

    def run(self) -> None:
        self.output_thread.start()
        self.input_thread.start()
        self.reader.ready.wait()
        # (this process is treadle's own; the front ends already know it is ready: the first
        # requests wait the ~0.1 s this takes in their socket, not the start)
        freeze_startup_heap()
        try:
            self.shutdown.running = True
            self._busy_loop()
        except FrontEndGone as e:
            logger.error("%s", e)  # nobody is left to tell
            self.engine.shutdown()
            exit_now(1)  # this host's CLI exits when this process has: seconds count
        except ExecutorStoppedError as e:
            logger.info("%s; shutting down", e)
            self._stop()
        except StoppedUnasked as e:
            logger.error("%s", e)
            self._die(self._death_report(e))
            raise SystemExit(1) from None
        except SystemExit as e:
            if e.code not in (0, None):
                self._die(self._death_report(e))
                raise
            self._stop()  # a third signal: at once
        except BaseException as e:
            report = self._death_report(e)  # (its log tail without the traceback below)
            logger.exception("Engine core failed; telling the front ends")
            self._die(report)
            raise SystemExit(1) from e
        else:
            self._stop()

    def _stop(self) -> None:
        """A clean end: every request still here is aborted (so every stream ends), every front
        end hears ENGINE_CORE_STOPPED, and the process exits 0."""
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # asked again: we are stopping
        try:
            self._abort_all()
        except Exception:  # the scheduler may be half way through a step that was cut short
            logger.warning("Could not abort the running requests", exc_info=True)
        self.output_queue.put(self.seal([ENGINE_CORE_STOPPED]))
        self.output_queue.put(None)
        self.output_thread.join(10.0)
        self.engine.shutdown()
        logger.info("Engine core stopped")

    def _death_report(self, error: BaseException) -> DeathReport:
        """`error`, where it was raised, and this process's last log lines before it."""
        lines = list(self.log_tail.lines) if self.log_tail is not None else []
        return DeathReport.of(self.dp_rank, error, lines)

    def _die(self, report: DeathReport) -> None:
        """A fatal error: every front end hears ENGINE_CORE_DEAD with its `report` (from here
        if the output thread is gone); the workers are stopped, or exiting would wait on
        them."""
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        dead = self.seal([ENGINE_CORE_DEAD, msgspec.msgpack.encode(report)])
        if self.output_thread.is_alive():
            self.output_queue.put(dead)
            self.output_queue.put(None)
            self.output_thread.join(5.0)
        else:
            send_to_all(self.ctx, self.output_addresses, dead)
        self.engine.shutdown()

    def _busy_loop(self) -> None:
        engine = self.engine
        deadline: float | None = None
        while True:
            self.shutdown.check_unasked()
            if self.shutdown.requested:
                if deadline is None:
                    deadline = time.monotonic() + self.shutdown_timeout
                if not engine.has_unfinished_requests():
                    return
                if self.shutdown.signals >= 2 or time.monotonic() >= deadline:
                    return  # run() aborts what is left
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

    def wake(self) -> None:
        """Cut the idle loop's wait for input short (up to `_POLL_MS`), so that a stop is seen
        at once: an empty abort, put by a thread of its own (a signal handler runs in the
        loop's thread, which may hold the queue's lock)."""
        item: InputItem = (EngineCoreRequestType.ABORT, [])
        threading.Thread(target=self.input_queue.put, args=(item,), daemon=True).start()

    def _tell_coordinator(self) -> None:
        out = self.waves.report(self.engine)
        if out is not None:
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
            self.waves.joined(req.current_wave)
            self.engine.add_request(req)  # never raises: a bad request is refused
        elif kind is EngineCoreRequestType.REFUSE:
            self.engine.refuse(*payload)
        elif kind is EngineCoreRequestType.START_DP_WAVE:
            wave: StartDPWave = payload
            self.waves.joined(wave.wave)
            if wave.exclude != self.dp_rank:
                logger.debug(
                    "START_DP_WAVE: joining wave %d, started by engine %d", wave.wave, wave.exclude
                )
        elif kind is EngineCoreRequestType.ABORT:
            self.engine.abort_requests(payload)
        elif kind is EngineCoreRequestType.UTILITY:
            self._call_utility(payload)
        elif kind is EngineCoreRequestType.EXECUTOR_FAILED:
            raise payload if isinstance(payload, Exception) else RuntimeError(payload)
        elif kind is EngineCoreRequestType.FRONTEND_DROPPED:
            self._abort_client(payload)
        elif kind is EngineCoreRequestType.FRONTEND_GONE:
            raise FrontEndGone(payload)

    def _executor_failed(self, reason: str, stopped: bool = False) -> None:
        """Called from the executor's monitor thread: the busy loop raises on it (or, for a
        worker that stopped cleanly, stops)."""
        if stopped:
            error = ExecutorStoppedError(reason)
            self.input_queue.put((EngineCoreRequestType.EXECUTOR_FAILED, error))
            return
        self.input_queue.put((EngineCoreRequestType.EXECUTOR_FAILED, f"executor failed: {reason}"))

    def _io_failed(self, reason: str) -> None:
        """Called by an IO thread that ends: the engine cannot talk any more, so it dies."""
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
            if call.method == RELEASE:  # POST /scale removes this engine core: as SIGUSR1
                if not self.shutdown.asked:
                    logger.info("Released by a front end (POST /scale); shutting down")
                self.shutdown.asked = True
            else:
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

    def _abort_client(self, client_index: int) -> None:
        """Front end `client_index`'s connection dropped: its requests are aborted (their KV
        freed), and it is told, in case it still lives (a dead one's successor on the same
        socket drops what it does not know)."""
        ids = self.engine.requests_of(client_index)
        if ids:
            logger.warning(
                "Aborting the %d request(s) of front end %d: its connection dropped",
                len(ids),
                client_index,
            )
            self._abort({client_index: ids}, "the front end's connection dropped")

    def _abort_all(self) -> None:
        by_client: dict[int, list[str]] = {}
        for rid, req in self.engine.scheduler.requests.items():
            by_client.setdefault(req.client_index, []).append(rid)
        self._abort(by_client, "shutdown")

    def _abort(self, by_client: dict[int, list[str]], reason: str) -> None:
        """Abort these requests (by front end) and send each its end."""
        for client, ids in by_client.items():
            self.engine.abort_requests(ids)
            ends = [
                EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT, stop_reason=reason)
                for r in ids
            ]
            self.output_queue.put(
                (client, EngineCoreOutputs(self.dp_rank, ends, timestamp=time.time()))
            )
