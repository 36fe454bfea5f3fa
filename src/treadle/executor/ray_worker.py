"""One rank under Ray (`--distributed-executor-backend ray`): the actor `RayExecutor` places
(`ray.remote(RayWorker)`: `start` joins the group, loads the shard and returns its reply
queue's handle; `loop` serves the broadcast queue until STOP_WORKER) and the environment it
gets (`actor_env`). The steps go through treadle's queues, not through Ray.
"""

from __future__ import annotations

import os

import ray
import torch.distributed as dist

from treadle.config import EngineConfig
from treadle.ipc import cluster_auth
from treadle.ipc.process import set_process_title
from treadle.ipc.shm_broadcast import Handle, MessageQueue
from treadle.ipc.zmq_utils import get_ip
from treadle.wire.topology import worker_title
from treadle.wire.worker import reader_codec, reply_codec
from treadle.worker.worker import Worker
from treadle.worker.worker_proc import busy_loop, start_worker


class RayWorker:
    """The actor of one rank (`ray.remote(RayWorker)`): `start` then `loop`, once each."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.replies: MessageQueue | None = None
        self.args: tuple[int, str, Handle] | None = None

    def pid(self) -> int:
        return os.getpid()

    def start(
        self,
        config: EngineConfig,
        rank: int,
        broadcast_handle: Handle,
        store: tuple[str, int],
        stage_addresses: list[str | None] | None,
        local: bool,
        secret: str | None = None,
    ) -> Handle:
        """Join the group, load the shard; the reply queue's handle (shared memory when the
        engine core is on this node, else its tcp XPUB). `secret`: the cluster secret given
        as TREADLE_CLUSTER_SECRET, which comes as an argument, never in the actor's
        runtime_env (that shows in `ray list actors --detail` and the dashboard)."""
        if secret is not None:
            os.environ[cluster_auth.ENV_SECRET] = secret
        parallel = config.parallel
        title = worker_title(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        _set_title(title)
        self.worker = start_worker(config, rank, parallel.world_size, store, stage_addresses)
        self.replies = (
            MessageQueue(1, 1)
            if local
            else MessageQueue(1, 0, connect_ip=get_ip(), codec=reply_codec(cross_host=True))
        )
        self.args = (rank, title, broadcast_handle)
        return self.replies.export_handle()

    def loop(self) -> None:
        """Serve the broadcast queue until STOP_WORKER (or its shutdown)."""
        assert self.worker is not None and self.replies is not None and self.args is not None
        rank, title, handle = self.args
        _set_title(title)  # Ray titles the process after each call it starts
        requests = MessageQueue.create_from_handle(handle, rank, reader_codec(handle.codec))
        try:
            requests.wait_until_ready()
            self.replies.wait_until_ready()
            busy_loop(self.worker, rank, title, requests, self.replies)
        finally:
            requests.close()
            self.replies.close()
            if self.worker.link is not None:
                self.worker.link.close()
            if dist.is_initialized():
                dist.destroy_process_group()


def _set_title(title: str) -> None:
    """`treadle::Worker_TP<r>` in `ps`, as under mp: Ray titles its workers with its own copy of
    setproctitle, which the setproctitle package's call does not override."""
    set_process_title(title)
    ray_title = getattr(ray._raylet, "setproctitle", None)
    if ray_title is not None:
        ray_title(f"treadle::{title}")


def actor_env(ip: str, threads: int | None) -> dict[str, str]:
    """A rank's environment (its actor's runtime_env, which anyone who can list the cluster's
    actors can read): this process's TREADLE_* settings but the cluster secret (`start` gets
    that as an argument), its node's address, and its bundle's CPUs unless pinned."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith("TREADLE_") and k != cluster_auth.ENV_SECRET
    }
    env["TREADLE_HOST_IP"] = ip
    if threads is not None:
        env["TREADLE_CPU_THREADS"] = str(threads)
    return env
