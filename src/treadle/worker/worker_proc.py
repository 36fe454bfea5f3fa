"""The worker process (tensor and pipeline parallelism): one per rank, fed through the
broadcast `MessageQueue`, replying on its own `MessageQueue(1, 1)` (ARCHITECTURE §4, §6).
Rank = pp_rank * tp_size + tp_rank (vLLM's order); a pipeline stage's ranks pass their
output to the next stage's rank of the same TP rank (`pp_transfer.py`).

Start-up, in the same order as the executor: join the torch.distributed group (gloo on CPU,
NCCL on CUDA; one TP group per stage) -> link to the neighbouring stages -> load this rank's
shard (its stage's layers only) -> READY with the reply queue's handle on the ready
pipe -> ready barrier of the broadcast queue -> ready barrier of the reply queue. Then each
message `(method, args, kwargs, output_rank)` runs `getattr(worker, method)`; only
`output_rank` (or every rank, when None) replies `(method, ok, result or error text)`.
"""

from __future__ import annotations

import os
import signal
import traceback
from typing import Any

import torch
import torch.distributed as dist

from treadle.config import EngineConfig
from treadle.ipc.fast_exit import exit_now
from treadle.ipc.process import ReadyPipe, at_parent_death, freeze_startup_heap, parent_gone
from treadle.ipc.secure_store import SecureStore
from treadle.ipc.shm_broadcast import (
    Handle,
    MessageQueue,
    MessageQueueShutdown,
    remove_orphaned_queue,
)
from treadle.logger import init_logger
from treadle.model.parallel import init_parallel
from treadle.wire.topology import worker_title
from treadle.wire.worker import reader_codec
from treadle.worker.pp_transfer import open_stage_link
from treadle.worker.worker import Worker

logger = init_logger(__name__)


# Broadcast by the executor's clean shutdown: each worker leaves its loop and exits 0. Every
# other message is (method, args, kwargs, output_rank): a call of `Worker.method` whose reply
# comes from `output_rank` (None: every rank).
STOP_WORKER: tuple[None, tuple[()], None, None] = (None, (), None, None)


def run_worker(
    ready: ReadyPipe,
    config: EngineConfig,
    rank: int,
    world_size: int,
    broadcast_handle: Handle,
    dist_init: str,
    stage_addresses: list[str | None] | None = None,
) -> None:
    """Process entry (`treadle.ipc.process.start_process` target). `stage_addresses[r]`:
    where rank r binds to receive the previous stage's output (None on the first stage; no
    list without pipeline parallelism; `pp_transfer.open_stage_link`)."""
    parent = os.getppid()
    serving = False
    parallel = config.parallel
    title = worker_title(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)

    def on_sigterm(signum: int, frame: Any) -> None:
        """SIGTERM to this worker alone must stop the whole engine, not this rank mid-step (the
        other ranks would fail in their collective): the first one while serving asks the
        engine core to stop (SIGUSR1), which drains and then stops every worker in order; a
        second one, or one while loading or with the engine core gone, exits at once."""
        nonlocal serving
        if serving and not parent_gone() and os.getppid() == parent:
            serving = False
            logger.info("%s: SIGTERM; asking the engine core to stop", title)
            os.kill(parent, signal.SIGUSR1)
            return
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    worker = start_worker(config, rank, world_size, dist_init, stage_addresses)
    link = worker.link
    replies = MessageQueue(1, 1)
    # With the engine core gone (killed -9) nobody else removes its broadcast segment, and
    # this worker may be cut short (`os._exit` after the grace period) before its `finally`
    # removes its own reply queue: remove both as soon as the death pipe closes.
    orphans = [replies.export_handle()] + ([broadcast_handle] if rank == 0 else [])

    def remove_orphans() -> None:
        for handle in orphans:
            remove_orphaned_queue(handle)

    at_parent_death(remove_orphans)
    freeze_startup_heap()  # (the model is loaded)
    ready.send_ready(replies.export_handle())
    requests = MessageQueue.create_from_handle(
        broadcast_handle, rank, reader_codec(broadcast_handle.codec)
    )
    requests.wait_until_ready()
    replies.wait_until_ready()
    serving = True
    try:
        busy_loop(worker, rank, title, requests, replies)
    finally:
        requests.close()
        replies.close()
        # The engine core created the broadcast segment; if it died (killed -9), nobody else
        # will remove it. (The death pipe closes before this process is given a new parent.)
        if rank == 0 and (parent_gone() or os.getppid() != parent):
            remove_orphaned_queue(broadcast_handle)
        if link is not None:
            link.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    exit_now(0)  # STOP_WORKER: the interpreter's teardown (torch's) would only cost seconds


def start_worker(
    config: EngineConfig,
    rank: int,
    world_size: int,
    dist_init: str | tuple[str, int],
    stage_addresses: list[str | None] | None = None,
) -> Worker:
    """Join the torch.distributed group, link to the neighbouring stages, load this rank's
    shard. `dist_init`: a `file://` path (a `FileStore`), or the (host, port) of a `StoreServer`
    that the executor hosts (every rank connects to it as a client: no port is probed). The
    stage links meet in the same store (`open_stage_link`)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # (ranks of other hosts)
    else:
        torch.set_num_threads(config.parallel.model_threads())
    backend = "nccl" if device == "cuda" else "gloo"
    store: dist.Store
    if isinstance(dist_init, tuple):
        host, port = dist_init
        store = SecureStore(host, port)
    elif dist_init.startswith("file://"):
        store = dist.FileStore(dist_init.removeprefix("file://"), world_size)
    else:
        raise ValueError(f"dist_init {dist_init!r}: a file:// path or a store's (host, port)")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    tp = config.parallel.tensor_parallel_size
    pp = config.parallel.pipeline_parallel_size
    pp_rank, tp_rank = divmod(rank, tp)
    init_parallel(tp_rank, tp, pp_rank, pp, make_groups=True)
    link = None
    if pp > 1 and stage_addresses is not None:
        link = open_stage_link(store, rank, tp, pp, stage_addresses)
    worker = Worker(config, rank)
    worker.link = link
    worker.load_model()
    return worker


def busy_loop(
    worker: Worker, rank: int, title: str, requests: MessageQueue, replies: MessageQueue
) -> None:
    while True:
        try:
            method, args, kwargs, output_rank = requests.dequeue()
        except MessageQueueShutdown:
            return
        if method is None:  # STOP_WORKER
            return
        try:
            result: Any = getattr(worker, method)(*args, **(kwargs or {}))
            reply: tuple[str, bool, Any] = (method, True, result)
        except Exception as e:
            logger.error("%s: %s failed:\n%s", title, method, traceback.format_exc())
            reply = (method, False, f"{type(e).__name__}: {e}")
        if output_rank is None or output_rank == rank:
            replies.enqueue(reply)
