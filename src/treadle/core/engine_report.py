"""The engine core's part of `GET /topology` (the `get_topology` utility call): its process, its
workers' (same host: psutil), the channels it holds, its load, and its step rates
(`core/engine_stats.py:StepMeter`, fed by `EngineCore.step`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from treadle.executor.base import Executor
from treadle.ipc.proc_info import dead_process, parent_title, process_info
from treadle.ipc.shm_broadcast import Handle
from treadle.wire.topology import EngineChannels, EngineReport, QueueInfo

if TYPE_CHECKING:
    from treadle.core.engine_core import EngineCore


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


def engine_report(engine: EngineCore, channels: EngineChannels | None) -> EngineReport:
    title = f"EngineCore_DP{engine.engine_index}"
    processes = [process_info(os.getpid(), title) or dead_process(title, os.getpid())]
    report = EngineReport(
        dp_rank=engine.engine_index, processes=processes, channels=channels or EngineChannels()
    )
    executor = engine.executor
    if isinstance(executor, Executor):
        processes.extend(executor.worker_processes())
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
