"""What an engine core reports about itself for `GET /topology` (the `get_topology` utility
call): its process and its workers', the channels it holds, and its load. Map-shaped Structs
(not array-like): the front end passes them on as JSON."""

from __future__ import annotations

import msgspec

from treadle.wire.engine import SchedulerStats


class ProcessInfo(msgspec.Struct, kw_only=True):
    """One process, as psutil sees it on its own host."""

    title: str  # without the "treadle::" prefix, e.g. "EngineCore_DP0"
    pid: int
    host: str
    ppid: int = 0
    started: float = 0.0  # Unix time
    rss_bytes: int = 0
    cpu_percent: float = 0.0  # since the previous look at it by the same process (0 at first)
    status: str = ""  # psutil's: running, sleeping, zombie, ...
    ray_node_id: str = ""  # a Ray worker actor's node (its ppid is then its owner's pid)


class QueueInfo(msgspec.Struct, kw_only=True):
    """A shared-memory `MessageQueue` (ARCHITECTURE §4)."""

    name: str  # the POSIX shared-memory segment
    chunks: int
    chunk_bytes: int
    readers: int
    overflow_address: str = ""  # XPUB for messages larger than a chunk
    notify_address: str = ""  # XPUB that wakes parked readers


class EngineChannels(msgspec.Struct, kw_only=True):
    """The engine core's ZMQ endpoints, as the handshake gave them: `inputs[i]` and
    `outputs[i]` are API server i's ROUTER and PULL."""

    inputs: list[str] = []
    outputs: list[str] = []
    coordinator_input: str = ""  # the coordinator's XPUB (the engine XSUBs)
    coordinator_output: str = ""  # the coordinator's PULL (the engine PUSHes)


class EngineReport(msgspec.Struct, kw_only=True):
    dp_rank: int
    # The engine core first, then its workers by TP rank, then (a --headless host) the CLI
    # process that started it.
    processes: list[ProcessInfo]
    channels: EngineChannels
    broadcast: QueueInfo | None = None  # engine core -> every worker
    worker_replies: list[QueueInfo] = []  # worker t -> engine core
    collective_backend: str = ""  # torch.distributed between the workers: gloo or nccl
    num_blocks: int = 0
    used_blocks: int = 0
    block_size: int = 0
    stats: SchedulerStats = msgspec.field(default_factory=SchedulerStats)
    steps: int = 0  # since start
    generated_tokens: int = 0
    steps_per_s: float = 0.0  # over the last few seconds
    scheduled_tokens_per_s: float = 0.0
    generated_tokens_per_s: float = 0.0


def worker_title(rank: int, tp: int, pp: int) -> str:
    """A worker's name in titles, logs and `/topology`: `Worker_TP<rank>`, or with several
    pipeline stages `Worker_PP<p>_TP<t>`."""
    if pp == 1:
        return f"Worker_TP{rank}"
    return f"Worker_PP{rank // tp}_TP{rank % tp}"
