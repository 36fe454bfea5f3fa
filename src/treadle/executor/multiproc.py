"""`MultiprocExecutor`: one worker process per rank when TP x PP >= 2 (ARCHITECTURE §6).

Calls go out once through a shared-memory broadcast `MessageQueue`; each worker answers on its
own `MessageQueue(1, 1)`. Replies are read in call order, so futures resolve FIFO. A worker's
error comes back as `RuntimeError("Worker failed with error '...'")`; no reply in time is a
`TimeoutError`. A monitor thread turns a dead worker into a failure of every pending and later
call (the engine core then dies loudly instead of hanging); a worker that exited 0 was stopped
on purpose (`ExecutorStoppedError`: the engine core stops cleanly).
"""

from __future__ import annotations

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
from treadle.config import EngineConfig
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
from treadle.logger import init_logger
from treadle.model.arch import ModelArch
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput
from treadle.worker.worker_proc import STOP_WORKER, run_worker

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


def check_parallel_layout(arch: ModelArch, tp: int) -> None:
    """Reject a layout the model cannot be split into, before any process starts."""
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


class MultiprocExecutor:
    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArch,
        max_model_len: int,
        failure_callback: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.world_size = config.parallel.world_size
        # What the workers' collectives run on (`run_worker` picks the same), for /topology.
        self.collective_backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.max_model_len = max_model_len
        self.arch = arch
        self.failure: str | None = None
        self.stopped = False  # the failure is a worker that exited 0
        # Told at once when a worker dies, even while idle: `failure_callback(reason, stopped)`.
        self.failure_callback = failure_callback
        self.workers: list[ChildProcess] = []
        self.reply_queues: list[MessageQueue] = []
        self.reply_handles: list[Handle] = []
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
                            f"Worker_TP{rank}",
                            args=(
                                config,
                                rank,
                                self.world_size,
                                handle,
                                f"file://{self._dist_file}",
                            ),
                            ctx=ctx,
                        )
                    )
            self.reply_handles = wait_for_ready(self.workers, timeout=envs.engine_ready_timeout_s())
            self.reply_queues = [MessageQueue.create_from_handle(h, 0) for h in self.reply_handles]
            self.broadcast.wait_until_ready()
            for queue in self.reply_queues:
                queue.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self.monitor = ProcessMonitor(self.workers, self._on_worker_death)

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
        if self.failure is not None:
            raise self._failed()
        self.broadcast.enqueue((method, args, kwargs, unique_reply_rank), timeout=timeout)
        ranks = range(self.world_size) if unique_reply_rank is None else [unique_reply_rank]
        results = []
        for rank in ranks:
            try:
                ok, result = self.reply_queues[rank].dequeue(timeout=timeout)
            except MessageQueueShutdown:
                raise self._failed() from None
            if not ok:
                if self._a_worker_stopped():  # a collective cut short by a rank that left
                    raise ExecutorStoppedError(self.failure)
                dead = [
                    f"{w.describe()} died: {describe_exit(code)}"
                    for w in self.workers
                    if (code := w.exitcode) not in (None, 0)
                ]
                if dead:  # what cut its collective short comes first
                    raise RuntimeError(
                        f"the executor failed: {'; '.join(dead)} (Worker_TP{rank}: {result})"
                    )
                raise RuntimeError(f"Worker failed with error '{result}'")
            results.append(result)
        return results

    def determine_num_blocks(self) -> int:
        return int(min(self.collective_rpc("determine_num_blocks")))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        timeout = envs.execute_model_timeout_seconds()
        result: ModelRunnerOutput = self.collective_rpc(
            "execute_model", (sched,), timeout=timeout, unique_reply_rank=0
        )[0]
        return result

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
        if os.path.exists(self._dist_file):
            os.unlink(self._dist_file)
