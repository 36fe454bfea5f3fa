"""`MultiprocExecutor`: one worker process per rank when TP x PP >= 2 (ARCHITECTURE §6).

Ranks are ordered as vLLM's (rank = pp_rank * tp + tp_rank; titles `Worker_TP<t>`, or
`Worker_PP<p>_TP<t>` with several pipeline stages). `execute_model` is answered by the last
stage's first TP rank; `submit_model` / `wait` keep several steps in flight (the engine
core's batch queue), and any other call first collects their replies, in order.

Calls go out once through a shared-memory broadcast `MessageQueue`; each worker answers on its
own `MessageQueue(1, 1)`. Replies are read in call order, so futures resolve FIFO. A worker's
error comes back as `RuntimeError("Worker failed with error '...'")`; no reply in time is a
`TimeoutError`. A monitor thread turns a dead worker into a failure of every pending and later
call (the engine core then dies loudly instead of hanging); a worker that exited 0 was stopped
on purpose (`ExecutorStoppedError`: the engine core stops cleanly).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from treadle import envs
from treadle.config import EngineConfig, pp_layer_partition
from treadle.ipc.proc_info import dead_process, process_info
from treadle.ipc.process import (
    ChildProcess,
    ProcessMonitor,
    describe_exit,
    get_mp_context,
    shutdown_processes,
    start_process,
    wait_for_ready,
)
from treadle.ipc.shm_broadcast import (
    Handle,
    MessageQueue,
    MessageQueueShutdown,
    remove_orphaned_queue,
)
from treadle.ipc.zmq_utils import get_open_zmq_ipc_path, remove_ipc_files
from treadle.logger import init_logger
from treadle.model.arch import ModelArch
from treadle.wire.topology import ProcessInfo
from treadle.wire.worker import (
    ModelRunnerOutput,
    SchedulerOutput,
    reader_codec,
)
from treadle.worker.worker_proc import STOP_WORKER, run_worker, worker_title

logger = init_logger(__name__)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Start workers with SIGINT ignored (inherited by fork and by spawn, since Python keeps
    an ignored SIGINT): Ctrl-C reaches the whole process group, and the engine core, not each
    worker, decides how to stop (it then terminates the workers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class ExecutorStoppedError(RuntimeError):
    """A worker was stopped (it exited 0): no more calls, but nothing went wrong."""


def check_parallel_layout(arch: ModelArch, tp: int, pp: int = 1) -> None:
    """Reject a layout the model cannot be split into, before any process starts."""
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
    pp_layer_partition(arch.num_layers, pp)  # a stage without a layer, a bad env partition
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if arch.num_heads % tp:
        raise ValueError(
            f"the model has {arch.num_heads} attention heads, not divisible by "
            f"tensor_parallel_size {tp}"
        )
    kv = arch.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(
            f"the model has {kv} KV heads: tensor_parallel_size {tp} must divide them or be a "
            "multiple of them"
        )
    if arch.intermediate_size % tp:
        raise ValueError(
            f"the MLP width {arch.intermediate_size} is not divisible by tensor_parallel_size {tp}"
        )


class PendingStep:
    """A submitted `execute_model` whose reply has not been read yet."""

    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = False
        self.result: ModelRunnerOutput | None = None
        self.error: BaseException | None = None


class MultiprocExecutor:
    reply_queues: list[MessageQueue]
    reply_handles: list[Handle]

    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArch,
        max_model_len: int,
        failure_callback: Callable[[str, bool], None] | None = None,
    ) -> None:
        self._init_state(config, arch, max_model_len, failure_callback)
        # Where each rank of a stage after the first receives the previous stage's output.
        self.stage_addresses: list[str | None] = [
            get_open_zmq_ipc_path() if self.pp_size > 1 and rank >= self.tp_size else None
            for rank in range(self.world_size)
        ]
        self.workers: list[ChildProcess] = []
        self.monitor: ProcessMonitor | None = None
        fd, self._dist_file = tempfile.mkstemp(prefix="treadle-dist-")
        os.close(fd)
        os.unlink(self._dist_file)  # torch's FileStore creates it
        self.broadcast = MessageQueue(self.world_size, max_chunk_bytes=envs.mq_max_chunk_bytes())
        try:
            ctx = get_mp_context()
            handle = self.broadcast.export_handle()
            with _sigint_ignored():
                for rank in range(self.world_size):
                    self.workers.append(
                        start_process(
                            run_worker,
                            worker_title(rank, self.tp_size, self.pp_size),
                            args=(
                                config,
                                rank,
                                self.world_size,
                                handle,
                                f"file://{self._dist_file}",
                                self.stage_addresses if self.pp_size > 1 else None,
                            ),
                            ctx=ctx,
                        )
                    )
            self.reply_handles = wait_for_ready(self.workers, timeout=envs.engine_ready_timeout_s())
            self.reply_queues = [
                MessageQueue.create_from_handle(h, 0, reader_codec(h.codec))
                for h in self.reply_handles
            ]
            self.broadcast.wait_until_ready()
            for queue in self.reply_queues:
                queue.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self.monitor = ProcessMonitor(self.workers, self._on_worker_death)

    def _init_state(
        self,
        config: EngineConfig,
        arch: ModelArch,
        max_model_len: int,
        failure_callback: Callable[[str, bool], None] | None,
    ) -> None:
        """What the calls below rely on, whoever starts the workers (`RayExecutor` too)."""
        self.world_size = config.parallel.world_size
        self.tp_size = config.parallel.tensor_parallel_size
        self.pp_size = config.parallel.pipeline_parallel_size
        self.output_rank = (self.pp_size - 1) * self.tp_size  # the last stage's first rank
        self._pending: collections.deque[PendingStep] = collections.deque()
        # What the workers' collectives run on (`run_worker` picks the same), for /topology.
        self.collective_backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.max_model_len = max_model_len
        self.arch = arch
        self.failure: str | None = None
        self.stopped = False  # the failure is a worker that exited 0
        # Told at once when a worker dies, even while idle: `failure_callback(reason, stopped)`.
        self.failure_callback = failure_callback
        self.reply_queues = []
        self.reply_handles = []
        self._dist_file = ""  # the FileStore of one host's ranks (none: another store)

    def worker_processes(self) -> list[ProcessInfo]:
        """The workers as /topology shows them."""
        infos = []
        for rank, worker in enumerate(self.workers):
            name = worker_title(rank, self.tp_size, self.pp_size)
            info = process_info(worker.pid, name) if worker.pid else None
            infos.append(info or dead_process(name, worker.pid))
        return infos

    def _on_worker_death(self, child: ChildProcess) -> None:
        self.stopped = child.exitcode == 0
        verb = "stopped" if self.stopped else "died"
        self.failure = f"{child.describe()} {verb}: {describe_exit(child.exitcode)}"
        for queue in self.reply_queues:
            queue.shutdown()  # wakes a collective_rpc that waits for a reply
        if self.failure_callback is not None:
            self.failure_callback(self.failure, self.stopped)

    def _a_worker_stopped(self, wait_s: float = 1.0) -> bool:
        """After an error reply: did a worker exit 0 (stopped on purpose) around then? Its
        peers' collectives fail first; its exit follows within moments."""
        deadline = time.monotonic() + wait_s
        while not self.stopped and time.monotonic() < deadline:
            if any(w.exitcode == 0 for w in self.workers):
                self.stopped = True
                self.failure = self.failure or "a worker stopped"
            elif any(w.exitcode is not None for w in self.workers):
                return False
            time.sleep(0.05)
        return self.stopped

    def _dead_workers(self) -> list[str]:
        """'<worker> died: <how>' for each worker known to be dead."""
        return [
            f"{w.describe()} died: {describe_exit(code)}"
            for w in self.workers
            if (code := w.exitcode) not in (None, 0)
        ]

    def _failed(self) -> RuntimeError:
        if self.stopped:
            return ExecutorStoppedError(self.failure)
        return RuntimeError(f"the executor failed: {self.failure}")

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        while self._pending:  # replies to steps in flight come first on their queue
            self._resolve_oldest()
        if self.failure is not None:
            raise self._failed()
        self.broadcast.enqueue((method, args, kwargs, unique_reply_rank), timeout=timeout)
        ranks = range(self.world_size) if unique_reply_rank is None else [unique_reply_rank]
        return [self._reply(rank, timeout) for rank in ranks]

    def _reply(self, rank: int, timeout: float | None) -> Any:
        try:
            _, ok, result = self.reply_queues[rank].dequeue(timeout=timeout)
        except MessageQueueShutdown:
            raise self._failed() from None
        if not ok:
            if self._a_worker_stopped():  # a collective cut short by a rank that left
                raise ExecutorStoppedError(self.failure)
            dead = self._dead_workers()
            title = worker_title(rank, self.tp_size, self.pp_size)
            if dead:  # what cut its collective short comes first
                raise RuntimeError(f"the executor failed: {'; '.join(dead)} ({title}: {result})")
            raise RuntimeError(f"Worker failed with error '{result}'")
        return result

    def submit_model(self, sched: SchedulerOutput) -> PendingStep:
        """Send a step to every worker without waiting for its reply (`wait` reads it)."""
        if self.failure is not None:
            raise self._failed()
        timeout = envs.execute_model_timeout_seconds()
        self.broadcast.enqueue(("execute_model", (sched,), None, self.output_rank), timeout)
        pending = PendingStep()
        self._pending.append(pending)
        return pending

    def _resolve_oldest(self) -> None:
        pending = self._pending.popleft()
        try:
            pending.result = self._reply(self.output_rank, envs.execute_model_timeout_seconds())
        except BaseException as e:
            pending.error = e
        pending.done = True

    def wait(self, pending: PendingStep) -> ModelRunnerOutput:
        """The reply to a submitted step (those submitted before it are read first)."""
        while not pending.done:
            self._resolve_oldest()
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    def determine_num_blocks(self) -> int:
        return int(min(self.collective_rpc("determine_num_blocks")))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.wait(self.submit_model(sched))

    def shutdown(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        # A worker died: its peers may hang in a collective that never completes, where no
        # signal handler runs; nothing of theirs is worth waiting for. Otherwise every worker
        # is told to stop in the broadcast queue, and exits 0 (a SIGTERM while serving would
        # ask this process to stop: see `run_worker`); one that does not in 5 s is
        # terminated, then killed.
        failed = self.failure is not None and not self.stopped
        if failed:
            for worker in self.workers:
                if worker.process.is_alive():
                    worker.process.kill()
        else:
            with contextlib.suppress(Exception):  # (a worker that left keeps its chunk)
                self.broadcast.enqueue(STOP_WORKER, timeout=1.0)
        self.broadcast.shutdown()
        shutdown_processes(self.workers, timeout=5.0)
        for queue in self.reply_queues:
            queue.close()
        # A worker killed -9 never removed the reply queue it created: do it for it.
        for worker, handle in zip(self.workers, self.reply_handles, strict=False):
            if worker.exitcode is not None and worker.exitcode < 0:
                remove_orphaned_queue(handle)
        self.broadcast.close()
        # A stage worker killed -9 leaves its socket file behind.
        remove_ipc_files(a for a in self.stage_addresses if a is not None)
        if self._dist_file and os.path.exists(self._dist_file):
            os.unlink(self._dist_file)
