"""The engine core's part of `GET /topology` (the `get_topology` utility call): its process, its
workers' (same host: psutil), the channels it holds, its load, and its step rates
(`StepMeter`, fed by `EngineCore.step`)."""

from __future__ import annotations

import collections
import os
import time
from typing import TYPE_CHECKING

from treadle.executor.multiproc import MultiprocExecutor
from treadle.ipc.proc_info import host_name, parent_title, process_info
from treadle.ipc.shm_broadcast import Handle
from treadle.wire.topology import EngineChannels, EngineReport, ProcessInfo, QueueInfo

if TYPE_CHECKING:
    from treadle.core.engine_core import EngineCore

RATE_WINDOW_S = 5.0
"""Step and token rates are averaged over about this long."""
_SAMPLE_EVERY_S = 0.25


class StepMeter:
    """Counts steps and tokens; `rates()` averages them over the last `RATE_WINDOW_S`.

    `on_step` costs two additions and a clock read; it stores a sample (the counts before
    the step) at most every `_SAMPLE_EVERY_S`. The rates run from the oldest sample inside
    the window to now, so after an idle spell they cover the burst since work resumed."""

    def __init__(self) -> None:
        self.steps = 0
        self.scheduled_tokens = 0
        self.generated_tokens = 0
        # (monotonic time, steps, scheduled tokens, generated tokens)
        self._samples: collections.deque[tuple[float, int, int, int]] = collections.deque()

    def on_step(
        self, scheduled_tokens: int, generated_tokens: int, now: float | None = None
    ) -> None:
        now = time.monotonic() if now is None else now
        if not self._samples or now - self._samples[-1][0] >= _SAMPLE_EVERY_S:
            self._samples.append((now, self.steps, self.scheduled_tokens, self.generated_tokens))
            while now - self._samples[0][0] > RATE_WINDOW_S:
                self._samples.popleft()
        self.steps += 1
        self.scheduled_tokens += scheduled_tokens
        self.generated_tokens += generated_tokens

    def rates(self, now: float | None = None) -> tuple[float, float, float]:
        """(steps/s, scheduled tokens/s, generated tokens/s)."""
        now = time.monotonic() if now is None else now
        for t, steps, scheduled, generated in self._samples:
            if now - t <= RATE_WINDOW_S:
                span = max(now - t, _SAMPLE_EVERY_S)
                return (
                    (self.steps - steps) / span,
                    (self.scheduled_tokens - scheduled) / span,
                    (self.generated_tokens - generated) / span,
                )
        return 0.0, 0.0, 0.0


def queue_info(handle: Handle) -> QueueInfo | None:
    if handle.buffer_handle is None:
        return None
    readers, chunk_bytes, chunks, name = handle.buffer_handle
    return QueueInfo(
        name=name,
        chunks=chunks,
        chunk_bytes=chunk_bytes,
        readers=readers,
        overflow_address=handle.local_subscribe_addr or "",
        notify_address=handle.local_notify_addr or "",
    )


def _dead(title: str, pid: int | None) -> ProcessInfo:
    return ProcessInfo(title=title, pid=pid or 0, host=host_name(), status="dead")


def engine_report(engine: EngineCore, channels: EngineChannels | None) -> EngineReport:
    title = f"EngineCore_DP{engine.engine_index}"
    processes = [process_info(os.getpid(), title) or _dead(title, os.getpid())]
    report = EngineReport(
        dp_rank=engine.engine_index, processes=processes, channels=channels or EngineChannels()
    )
    executor = engine.executor
    if isinstance(executor, MultiprocExecutor):
        for rank, worker in enumerate(executor.workers):
            name = f"Worker_TP{rank}"
            info = process_info(worker.pid, name) if worker.pid else None
            processes.append(info or _dead(name, worker.pid))
        report.broadcast = queue_info(executor.broadcast.export_handle())
        report.worker_replies = [q for h in executor.reply_handles if (q := queue_info(h))]
        report.collective_backend = executor.collective_backend
    parent, parent_name = parent_title()
    if parent_name == "Headless":  # the CLI of an engines-only host: no API server sees it
        processes.extend(p for p in [process_info(parent, parent_name)] if p is not None)
    kv = engine.scheduler.kv
    report.num_blocks = kv.num_blocks
    report.used_blocks = kv.num_blocks - len(kv.free)
    report.block_size = kv.block_size
    report.stats = engine.get_stats()
    meter = engine.meter
    report.steps, report.generated_tokens = meter.steps, meter.generated_tokens
    steps, scheduled, generated = meter.rates()
    report.steps_per_s = steps
    report.scheduled_tokens_per_s = scheduled
    report.generated_tokens_per_s = generated
    return report
