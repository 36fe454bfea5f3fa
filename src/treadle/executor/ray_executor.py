"""`RayExecutor` (`--distributed-executor-backend ray`): Ray places and watches the workers; the
steps do not go through Ray (issue 22, item 3; as vLLM's Ray executor).

Start-up, in the engine core (the Ray driver):

1. `ray.init(address=$RAY_ADDRESS or "auto")`; with no cluster to join, a local one is started
   for this engine core (vLLM does the same), which then lives and dies with it: `ray start
   --head` once makes restarts cheaper.
2. Placement (`executor/ray_placement.py`): with -tp > 1 one STRICT_PACK group per pipeline
   stage (its TP ranks on one node, so no all-reduce crosses hosts) when the cluster can give
   it within 5 s; else one PACK group of tp x pp bundles `{"CPU": threads}` (as few nodes as
   possible); one that cannot be placed within TREADLE_RAY_PLACEMENT_TIMEOUT_S (60) is an
   error that names `ray status`.
3. Ranks follow the nodes: whole stages first, this node's leading, so that a stage's TP ranks
   share a node whenever the placement allows (`stage_order`; a stage that PACK had to
   split works, its all-reduce over tcp, and is logged). One named actor per rank
   (`treadle-<id>-Worker_TP<r>`), with this process's TREADLE_* environment, TREADLE_HOST_IP
   set to its node's address and TREADLE_CPU_THREADS to its bundle's CPUs.
4. The same queues as `MultiprocExecutor`: one broadcast `MessageQueue` whose readers on this
   node read shared memory and whose readers on other nodes read its tcp XPUB (CURVE with the
   cluster secret), and one reply queue per rank (tcp from another node). torch.distributed
   meets at a store that this process hosts (`ipc/secure_store.py`, CURVE-keyed with the
   cluster secret; its port read back, never probed).
5. Pipeline stage links (`pp_transfer.py`): ipc between ranks on one node, else tcp on the
   receiving rank's node address, port 0; the receiver publishes the real address in the same
   store and the sender reads it there. Sockets that face another node (the queues' tcp
   ends, tcp stage links) need the cluster secret unless they are loopback or
   `--insecure-cluster` says so (`_check_layout`).
6. Each actor (`ray_worker.py`)'s `start()` links its stages, loads its shard and returns its reply queue's
   handle; its `loop()` runs the worker's busy loop until STOP_WORKER.

A monitor thread `ray.wait`s on the loop calls: one that ends while serving is a dead worker,
reported as `MultiprocExecutor` reports a dead process (the engine core dies, the front end
restarts it, requests resume). Shutdown sends STOP_WORKER, then `ray.kill`s every actor and
removes the placement group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treadle import envs
from treadle.config import EngineConfig
from treadle.executor.base import Executor
from treadle.executor.ray_placement import alive_nodes, place, remove_groups
from treadle.executor.ray_worker import RayWorker, actor_env
from treadle.ipc import cluster_auth
from treadle.ipc.proc_info import process_info
from treadle.ipc.secure_store import StoreServer
from treadle.ipc.shm_broadcast import MessageQueue, remove_orphaned_queue
from treadle.ipc.zmq_utils import get_ip, get_open_zmq_ipc_path, get_tcp_uri, remove_ipc_files
from treadle.logger import init_logger
from treadle.wire.topology import ProcessInfo, worker_title
from treadle.wire.worker import call_codec, reader_codec
from treadle.worker.worker_proc import STOP_WORKER

logger = init_logger(__name__)


@dataclass
class RayRank:
    """Where one rank runs."""

    title: str
    actor_name: str
    node_id: str
    ip: str
    pid: int = 0

    def describe(self) -> str:
        return f"{self.title} (pid {self.pid}, Ray node {self.node_id[:12]} at {self.ip})"


def connect_ray() -> bool:
    """Join the Ray cluster (RAY_ADDRESS, else the one this host runs), else start a local one.
    Returns whether this call connected (so `shutdown` disconnects)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or "auto"
    with _signal_handlers_kept():
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except ConnectionError:
            if os.environ.get("RAY_ADDRESS"):
                raise
            logger.warning(
                "No Ray cluster to join (RAY_ADDRESS is unset and none runs on this host): "
                "starting a local one for this engine core (`ray start --head` first makes "
                "restarts cheaper)"
            )
            ray.init(logging_level=logging.WARNING)
    return True


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """`ray.init` makes SIGTERM `sys.exit` (and its core prints a stack on it): the engine
    core's own handlers (drain, then stop the workers) must stay."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)


class RayExecutor(Executor):
    """The executors' calls and queues over workers that Ray places (module docstring)."""

    _store: StoreServer | None = None
    _watcher: threading.Thread | None = None
    _connected = False  # this process called `ray.init` (and so `ray.shutdown`)
    _closing = False

    def _start(self, config: EngineConfig) -> None:
        # No child processes (`workers` stays empty): `ranks` says where each rank runs.
        self.ranks: list[RayRank] = []
        self._actors: list[Any] = []
        self._loops: list[Any] = []
        self._local: list[bool] = []
        self._groups: list[PlacementGroup] = []
        self._here = ""  # this engine core's Ray node
        self._connected = connect_ray()
        self._launch(config)

    def _watch_ranks(self) -> None:
        self._watcher = threading.Thread(target=self._watch, name="ray-monitor", daemon=True)
        self._watcher.start()

    # -- start-up -------------------------------------------------------------------------

    def _launch(self, config: EngineConfig) -> None:
        """Place the ranks, start one actor each, connect their queues."""
        self._tag = uuid.uuid4().hex[:8]
        threads = config.parallel.model_threads()
        self._groups, placed = place(self._tag, self.tp_size, self.pp_size, threads)
        nodes = alive_nodes()
        self._here = here = ray.get_runtime_context().get_node_id()
        driver_ip = nodes.get(here) or get_ip()
        for rank, (_, _, node) in enumerate(placed):
            title = worker_title(rank, self.tp_size, self.pp_size)
            self.ranks.append(
                RayRank(title, f"treadle-{self._tag}-{title}", node, nodes.get(node, "?"))
            )
        self._local = [r.node_id == here for r in self.ranks]
        if self.pp_size > 1:
            self.stage_addresses = self._stage_plan()
        self._check_layout(config, driver_ip)
        local = [rank for rank, on_here in enumerate(self._local) if on_here]
        self.broadcast = MessageQueue(
            self.world_size,
            n_local_reader=len(local),
            local_reader_ranks=local,
            max_chunk_bytes=envs.mq_max_chunk_bytes(),
            connect_ip=driver_ip,
            codec=call_codec(cross_host=len(local) < self.world_size),
        )
        self._store = StoreServer(driver_ip, 0)  # CURVE-keyed with the cluster secret
        store = (driver_ip, self._store.port)
        remote_worker = ray.remote(RayWorker)
        for rank, (pg, bundle, _) in enumerate(placed):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
            env = actor_env(self.ranks[rank].ip, None if config.parallel.cpu_threads else threads)
            self._actors.append(
                remote_worker.options(  # type: ignore[attr-defined]
                    name=self.ranks[rank].actor_name,
                    num_cpus=threads,
                    max_restarts=0,
                    scheduling_strategy=strategy,
                    runtime_env={"env_vars": env},
                ).remote()
            )
        for rank, pid in enumerate(ray.get([a.pid.remote() for a in self._actors])):
            self.ranks[rank].pid = pid
        stages = self.stage_addresses if self.pp_size > 1 else None
        secret = os.environ.get(cluster_auth.ENV_SECRET) or None
        handle = self.broadcast.export_handle()
        starts = [
            actor.start.remote(config, rank, handle, store, stages, on, secret)
            for rank, (actor, on) in enumerate(zip(self._actors, self._local, strict=True))
        ]
        self.reply_handles = self._get_all(starts, envs.engine_ready_timeout_s(), "load")
        self.reply_queues = [
            MessageQueue.create_from_handle(h, 0, reader_codec(h.codec)) for h in self.reply_handles
        ]
        self._loops = [actor.loop.remote() for actor in self._actors]
        self.broadcast.wait_until_ready(timeout=60)
        for queue in self.reply_queues:
            queue.wait_until_ready(timeout=60)
        logger.info(
            "Ray workers: %s",
            ", ".join(f"{r.title} on {r.ip} ({r.node_id[:8]})" for r in self.ranks),
        )

    def _stage_plan(self) -> list[str | None]:
        """Where each rank after the first stage binds to receive: ipc when its sender (the
        same TP rank, one stage before) is on its node, else tcp on its node's address."""
        plan: list[str | None] = [None] * self.world_size
        for rank in range(self.tp_size, self.world_size):
            me, sender = self.ranks[rank], self.ranks[rank - self.tp_size]
            same = me.node_id == sender.node_id
            plan[rank] = get_open_zmq_ipc_path() if same else get_tcp_uri(me.ip, 0)
        return plan

    def _check_layout(self, config: EngineConfig, driver_ip: str) -> None:
        """Refuse open sockets between hosts: the queues of ranks on other nodes (read from
        this node over tcp) and tcp stage links need the cluster secret, unless loopback or
        --insecure-cluster. A stage whose TP ranks span nodes is logged (it is slow)."""
        for stage in range(self.pp_size):
            ranks = self.ranks[stage * self.tp_size : (stage + 1) * self.tp_size]
            if len({r.node_id for r in ranks}) > 1:
                logger.warning(
                    "Pipeline stage %d's TP ranks run on several nodes (%s): its all-reduce "
                    "crosses hosts (give each node a multiple of -tp bundles to avoid it)",
                    stage,
                    ", ".join(f"{r.title} on {r.ip}" for r in ranks),
                )
        facing = []  # (host, what binds there for other nodes)
        remote = [r.title for r, on in zip(self.ranks, self._local, strict=True) if not on]
        if remote:
            facing.append((driver_ip, f"the steps that {', '.join(remote)} read from {driver_ip}"))
        for rank, address in enumerate(self.stage_addresses):
            if address is not None and address.startswith("tcp://"):
                r = self.ranks[rank]
                facing.append((r.ip, f"{r.title}'s stage link on {r.ip}"))
        exposed = [what for host, what in facing if not cluster_auth.is_loopback(host)]
        parallel = config.parallel
        keyed = parallel.cluster_secret_file or cluster_auth.configured()
        if exposed and not keyed and not parallel.insecure_cluster:
            raise ValueError(
                f"Ray placed the ranks on several nodes, and nothing keys the tcp sockets "
                f"between them ({'; '.join(exposed)}): give every host the same "
                "--cluster-secret-file (or TREADLE_CLUSTER_SECRET), or --insecure-cluster to "
                "accept open sockets"
            )

    def _get_all(self, refs: list[Any], timeout: float, what: str) -> list[Any]:
        """`ray.get` of one call per rank; a rank that fails names itself and its node."""
        results = []
        deadline = time.monotonic() + timeout
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except GetTimeoutError:
                raise TimeoutError(
                    f"{self.ranks[rank].describe()} did not {what} in {timeout:g} s "
                    "(TREADLE_ENGINE_READY_TIMEOUT_S)"
                ) from None
            except ray.exceptions.RayError as e:
                raise RuntimeError(
                    f"{self.ranks[rank].describe()} failed to {what}: {_cause(e)}"
                ) from None
        return results

    def worker_processes(self) -> list[ProcessInfo]:
        """Ranks on this node as psutil sees them, the others as Ray placed them; each with its
        Ray node and, as parent, this engine core (the actors' owner)."""
        infos = []
        for rank in self.ranks:
            info = process_info(rank.pid, rank.title) if rank.node_id == self._here else None
            if info is None:
                dead = self.failure is not None and self.failure.startswith(rank.describe())
                info = ProcessInfo(
                    title=rank.title, pid=rank.pid, host=rank.ip, status="dead" if dead else ""
                )
            info.ppid = os.getpid()
            info.ray_node_id = rank.node_id
            infos.append(info)
        return infos

    # -- liveness -------------------------------------------------------------------------

    def _watch(self) -> None:
        """A loop call that ends while serving: its rank died (or left)."""
        pending = list(self._loops)
        while pending and not self._closing:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            if not done or self._closing:
                continue
            rank = self._loops.index(done[0])
            try:
                ray.get(done[0])
                self.stopped, how = True, "stopped"
            except ray.exceptions.RayError as e:
                how = f"died: {_cause(e)}"
            if self._closing:
                return
            self.failure = f"{self.ranks[rank].describe()} {how}"
            for queue in self.reply_queues:
                queue.shutdown()  # wakes a collective_rpc that waits for a reply
            if self.failure_callback is not None:
                self.failure_callback(self.failure, self.stopped)
            return

    def _a_worker_stopped(self, wait_s: float = 1.0) -> bool:
        """After an error reply: give the monitor a moment to see the rank that cut the
        collective short (a peer's death reaches gloo before it reaches Ray)."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.stopped

    def _dead_workers(self) -> list[str]:
        return [self.failure] if self.failure is not None and not self.stopped else []

    # -- shutdown -------------------------------------------------------------------------

    def shutdown(self) -> None:
        self._closing = True
        broadcast = getattr(self, "broadcast", None)
        if broadcast is not None:
            if self._loops and (self.failure is None or self.stopped):
                with contextlib.suppress(Exception):
                    broadcast.enqueue(STOP_WORKER, timeout=1.0)
                with contextlib.suppress(Exception):
                    ray.wait(self._loops, num_returns=len(self._loops), timeout=5.0)
            broadcast.shutdown()
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        for queue in self.reply_queues:
            queue.close()
        # A killed actor never removed the reply queue it created on this node.
        for handle, on_here in zip(self.reply_handles, self._local, strict=False):
            if on_here:
                remove_orphaned_queue(handle)
        if broadcast is not None:
            broadcast.close()
        remove_ipc_files(a for a in self.stage_addresses if a is not None)
        remove_groups(self._groups)
        self._groups = []
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._watcher is not None:
            self._watcher.join(timeout=2.0)
        if self._connected and ray.is_initialized():
            ray.shutdown()


def _cause(error: BaseException) -> str:
    """The line of a Ray error that says why (e.g. "The actor died because its node has
    died. ..."), else its first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("The actor died because"):
            return " ".join(lines[i : i + 2])
    return lines[0] if lines else type(error).__name__
