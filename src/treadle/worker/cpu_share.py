"""Sharing the CPU with other processes (issue 24 item 7).

A decode step is hundreds of parallel regions (OpenMP, shared by PyTorch and treadle's
kernels), and each region ends when its slowest thread does. When another process takes one of
the cores the model's threads run on, every region waits for the thread the OS took away: one
busy loop beside a 2-thread engine on a 2-core machine made each token 95x slower (1,309 ms
against 13.8). One thread fewer costs at most the parallel speed-up instead.

So a worker whose thread count the user did not pin (`--cpu-threads`, `TREADLE_CPU_THREADS`)
looks, between steps and every `WINDOW_S`, at two numbers the kernel keeps:
- its run delay: how long its threads were runnable but waited for a core
  (`/proc/self/task/*/schedstat`, second field);
- the idle time of the CPUs it may run on (`/proc/stat`, the `cpuN` lines of its affinity).
Its threads waiting `SHRINK_AT` of a core or more: one thread fewer. Fewer threads than its
share and a whole core idle for `GROW_AFTER` windows in a row: one more. A neighbour that comes
and goes makes it wait longer before it grows again (`hold`, doubled up to `MAX_HOLD_S`).
Each change is logged. Where /proc is not Linux's, nothing changes.

`SHRINK_AT` sits between the two cases a 2-core server meets: a busy neighbour (one loop
beside 2 model threads: 3 threads on 2 cores, ~0.67 core-seconds a second of run delay; more
cores and threads, nearer 1) and the server's own work around a single stream (the API server
and a local client took ~0.35-0.4 a second from the model's threads: at 0.3 the count went
2 -> 1 -> 2 every few seconds, and a served token took 4.0-4.3 ms where 2 threads throughout
gave 3.4, peer_bench, 2026-12-06).

While they wait for each other, the threads spin briefly and then sleep: libgomp's default
(`GOMP_SPINCOUNT` 300,000 spins, 100 once there are more threads than CPUs; then a futex),
which `OMP_WAIT_POLICY` / `GOMP_SPINCOUNT` in the environment change as usual.

The governor keeps the count (this module imports no torch); the runner applies it: the torch
worker passes `torch.set_num_threads`, a runner of treadle's kernels alone reads `threads`.

A change of thread count changes outputs no more than a change of batch does: oneDNN blocks a
GEMM differently per thread count (logprobs move in the last bits, tests/worker/
test_cpu_share.py checks 1 against 2 threads); the GGUF kernels split by output column only.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from treadle.logger import init_logger
from treadle.parallel_config import ParallelConfig

logger = init_logger(__name__)

WINDOW_S = 0.5  # how often (at most) the readings are taken, between steps
SHRINK_AT = 0.5  # cores' worth of run delay (core-seconds per second) that costs a thread
GROW_IDLE = 0.6  # idle cores (of this process's CPUs) that count as a free core
GROW_AFTER = 2  # windows in a row with a free core before a thread is added
MIN_HOLD_S = 1.0  # after a thread is taken away, wait at least this long before adding one
MAX_HOLD_S = 8.0  # ... and at most this long, for a neighbour that keeps coming back
FLAP_S = 10.0  # a shrink this soon after a grow doubles the hold


_engine_process = False


def mark_engine_process() -> None:
    """Said by the engine core process when its model runs there (one rank): that model's
    thread count is the engine's (`model_threads()`). In a user's process (an in-process `LLM`)
    only a count the user chose is applied; otherwise the runtime's default stays."""
    global _engine_process
    _engine_process = True


def sets_model_threads(parallel: ParallelConfig) -> bool:
    """Whether a one-rank runner in this process sets its thread count to
    `parallel.model_threads()` when it is built (`mark_engine_process`). A TP/PP worker
    process sets its own (`worker_proc.start_worker`)."""
    return parallel.world_size == 1 and (_engine_process or parallel.threads_pinned())


@dataclass
class Reading:
    """What the kernel says at one moment: seconds since boot of run delay of this process's
    threads, and of idle time summed over the CPUs it may use."""

    when: float
    run_delay_s: float
    idle_s: float


def read_proc(cpus: set[int], proc: Path = Path("/proc")) -> Reading | None:
    """The current `Reading`, or None where /proc does not have it."""
    when = time.monotonic()
    delay_ns = 0
    try:
        for task in (proc / "self" / "task").iterdir():
            try:
                fields = (task / "schedstat").read_text().split()
            except OSError:  # the thread ended meanwhile
                continue
            delay_ns += int(fields[1])
        idle_ticks = 0
        for line in (proc / "stat").read_text().splitlines():
            name, _, rest = line.partition(" ")
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                values = rest.split()
                idle_ticks += int(values[3]) + int(values[4])  # idle + iowait
    except (OSError, ValueError, IndexError):
        return None
    return Reading(when, delay_ns / 1e9, idle_ticks / os.sysconf("SC_CLK_TCK"))


class ThreadGovernor:
    """The thread count of one process's model, between 1 and `most`: `threads`, the current
    one, which a runner passing it to each kernel call reads; `apply(n)`, where given, is
    called with each new count (the torch worker's `torch.set_num_threads`)."""

    def __init__(self, most: int, pinned: bool, apply: Callable[[int], None] | None = None) -> None:
        self.most = most
        self.threads = most
        self._apply = apply
        self.active = not pinned and most > 1 and hasattr(os, "sched_getaffinity")
        self._cpus = set(os.sched_getaffinity(0)) if self.active else set()
        self._last: Reading | None = None
        self._free_windows = 0
        self._hold_s = MIN_HOLD_S
        self._shrunk_at = -math.inf
        self._grew_at = -math.inf

    def after_step(self) -> None:
        """Called after each model step; reads /proc at most every WINDOW_S."""
        if not self.active:
            return
        if self._last is not None and time.monotonic() - self._last.when < WINDOW_S:
            return
        reading = read_proc(self._cpus)
        if reading is None:
            self.active = False
            return
        if self._last is not None:
            self.decide(self._last, reading)
        self._last = reading

    def decide(self, before: Reading, now: Reading) -> None:
        """Change the thread count from what happened between two readings."""
        span = now.when - before.when
        if span <= 0:
            return
        waiting = (now.run_delay_s - before.run_delay_s) / span
        idle = (now.idle_s - before.idle_s) / span
        if waiting >= SHRINK_AT and self.threads > 1:
            if now.when - self._grew_at < FLAP_S:
                self._hold_s = min(MAX_HOLD_S, self._hold_s * 2)
            self._shrunk_at = now.when
            self._free_windows = 0
            self._set(
                self.threads - 1,
                f"its threads waited {waiting:.2f} core-seconds a second for a core "
                "(another process is using this CPU)",
            )
            return
        self._free_windows = self._free_windows + 1 if idle >= GROW_IDLE else 0
        if (
            self.threads < self.most
            and self._free_windows >= GROW_AFTER
            and now.when - self._shrunk_at >= self._hold_s
        ):
            if now.when - self._shrunk_at > 6 * MAX_HOLD_S:
                self._hold_s = MIN_HOLD_S  # the neighbour has been gone a while
            self._grew_at = now.when
            self._free_windows = 0
            self._set(self.threads + 1, f"{idle:.1f} of its CPUs idle")

    def _set(self, threads: int, why: str) -> None:
        logger.info("Model threads %d -> %d of %d: %s", self.threads, threads, self.most, why)
        self.threads = threads
        if self._apply is not None:
            self._apply(threads)
