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

import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker

from treadle import envs
from treadle.config import EngineConfig
from treadle.executor.base import Executor
from treadle.ipc.proc_info import dead_process, process_info
from treadle.ipc.process import (
    get_mp_context,
    shutdown_processes,
    start_process,
    wait_for_ready,
)
from treadle.ipc.shm_broadcast import MessageQueue, remove_orphaned_queue
from treadle.ipc.zmq_utils import get_open_zmq_ipc_path, remove_ipc_files
from treadle.logger import init_logger
from treadle.wire.topology import ProcessInfo, worker_title
from treadle.wire.worker import (
    reader_codec,
)
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


class MultiprocExecutor(Executor):
    """The ranks are processes of this host (module docstring)."""

    _dist_file = ""  # the FileStore of this host's ranks

    def _start(self, config: EngineConfig) -> None:
        self.stage_addresses = [
            get_open_zmq_ipc_path() if self.pp_size > 1 and rank >= self.tp_size else None
            for rank in range(self.world_size)
        ]
        fd, self._dist_file = tempfile.mkstemp(prefix="treadle-dist-")
        os.close(fd)
        os.unlink(self._dist_file)  # torch's FileStore creates it
        self.broadcast = MessageQueue(self.world_size, max_chunk_bytes=envs.mq_max_chunk_bytes())
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
            MessageQueue.create_from_handle(h, 0, reader_codec(h.codec)) for h in self.reply_handles
        ]
        self.broadcast.wait_until_ready()
        for queue in self.reply_queues:
            queue.wait_until_ready()

    def worker_processes(self) -> list[ProcessInfo]:
        """The workers as /topology shows them."""
        infos = []
        for rank, worker in enumerate(self.workers):
            name = worker_title(rank, self.tp_size, self.pp_size)
            info = process_info(worker.pid, name) if worker.pid else None
            infos.append(info or dead_process(name, worker.pid))
        return infos

    def shutdown(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        # A worker died: its peers may hang in a collective that never completes, where no
        # signal handler runs; nothing of theirs is worth waiting for. Otherwise every worker
        # is told to stop in the broadcast queue, and exits 0 (a SIGTERM while serving would
        # ask this process to stop: see `run_worker`); one that does not in 5 s is
        # terminated, then killed.
        failed = self.failure is not None and not self.stopped
        broadcast = getattr(self, "broadcast", None)  # (none: `_start` failed before it)
        if failed:
            for worker in self.workers:
                if worker.process.is_alive():
                    worker.process.kill()
        elif broadcast is not None:
            with contextlib.suppress(Exception):  # (a worker that left keeps its chunk)
                broadcast.enqueue(STOP_WORKER, timeout=1.0)
        if broadcast is not None:
            broadcast.shutdown()
        shutdown_processes(self.workers, timeout=5.0)
        for queue in self.reply_queues:
            queue.close()
        # A worker killed -9 never removed the reply queue it created: do it for it, and
        # tell the resource tracker that it shares with this process (fork and spawn pass it
        # on), which would otherwise warn of "leaked shared_memory objects" at exit.
        for worker, handle in zip(self.workers, self.reply_handles, strict=False):
            if worker.exitcode is not None and worker.exitcode < 0:
                remove_orphaned_queue(handle)
                if handle.buffer_handle:
                    with contextlib.suppress(Exception):  # (no tracker, or one gone)
                        resource_tracker.unregister("/" + handle.buffer_handle[3], "shared_memory")
        if broadcast is not None:
            broadcast.close()
        # A stage worker killed -9 leaves its socket file behind.
        remove_ipc_files(a for a in self.stage_addresses if a is not None)
        if self._dist_file and os.path.exists(self._dist_file):
            os.unlink(self._dist_file)
