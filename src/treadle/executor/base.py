"""`Executor`: what every executor of worker processes shares (ARCHITECTURE §6), whoever
starts the ranks: the one `__init__` (its state, then `_start`, which undoes itself with
`shutdown` if it fails, then `_watch_ranks`), the calls through the broadcast queue and the
reply queues (`collective_rpc`, `submit_model` / `wait`), and how a dead rank fails them.

A subclass says how its ranks start (`_start`: local processes in `MultiprocExecutor`, over
several hosts in `MultinodeExecutor`, Ray actors in `RayExecutor`), how they are watched
(`_watch_ranks`), shown (`worker_processes`) and stopped (`shutdown`). World size 1 needs
none of this: `UniProcExecutor` calls its one worker in the engine core's process.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from treadle import envs
from treadle.config import EngineConfig
from treadle.ipc.process import ChildProcess, ProcessMonitor, describe_exit
from treadle.ipc.shm_broadcast import Handle, MessageQueue, MessageQueueShutdown
from treadle.model.arch import ModelArch
from treadle.wire.topology import ProcessInfo, worker_title
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput


def collective_backend() -> str:
    """What the workers' collectives run on (`run_worker` picks the same): NCCL where CUDA
    is, else gloo."""
    import torch  # (the workers run on it; this process may not have it yet)

    return "nccl" if torch.cuda.is_available() else "gloo"


class ExecutorStoppedError(RuntimeError):
    """A worker was stopped (it exited 0): no more calls, but nothing went wrong."""


class PendingStep:
    """A submitted `execute_model` whose reply has not been read yet."""

    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = False
        self.result: ModelRunnerOutput | None = None
        self.error: BaseException | None = None


class Executor:
    broadcast: MessageQueue  # set by `_start`
    reply_queues: list[MessageQueue]
    reply_handles: list[Handle]

    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArch,
        max_model_len: int,
        failure_callback: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.world_size = config.parallel.world_size
        self.tp_size = config.parallel.tensor_parallel_size
        self.pp_size = config.parallel.pipeline_parallel_size
        self.output_rank = (self.pp_size - 1) * self.tp_size  # the last stage's first rank
        self._pending: collections.deque[PendingStep] = collections.deque()
        # For /topology, which shows it between workers only (one process has no collectives).
        self.collective_backend = collective_backend() if self.world_size > 1 else ""
        self.max_model_len = max_model_len
        self.arch = arch
        self.failure: str | None = None
        self.stopped = False  # the failure is a worker that exited 0
        # Told at once when a worker dies, even while idle: `failure_callback(reason, stopped)`.
        self.failure_callback = failure_callback
        self.reply_queues = []
        self.reply_handles = []
        self.workers: list[ChildProcess] = []  # this host's worker processes (Ray: none)
        self.monitor: ProcessMonitor | None = None
        # Where each rank of a stage after the first receives the previous stage's output.
        self.stage_addresses: list[str | None] = [None] * self.world_size
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise
        self._watch_ranks()

    def _start(self, config: EngineConfig) -> None:
        """Start every rank; set `broadcast`, `reply_handles` and `reply_queues`."""
        raise NotImplementedError

    def _watch_ranks(self) -> None:
        """From now on, turn a dead rank into a failure (`_on_worker_death`); by default
        through the sentinels of this host's worker processes."""
        self.monitor = ProcessMonitor(self.workers, self._on_worker_death)

    def worker_processes(self) -> list[ProcessInfo]:
        """The workers as /topology shows them."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop every rank and remove what they left (safe after a failed `_start`)."""
        raise NotImplementedError

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
