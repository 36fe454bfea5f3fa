"""One model's ranks across hosts without Ray (`--nnodes N --node-rank R --master-addr A
--master-port P`, vLLM's `mp` route; issue 22, item 2).

Ranks are node-major: node r runs ranks [r*k, (r+1)*k), k = tp x pp / nnodes.

Node 0 (`treadle serve M ... --nnodes N --node-rank 0`): the API server, the engine core and
`MultinodeExecutor`, which

1. serves the rendezvous store on A:P (that address only: `ipc/secure_store.py`'s
   `StoreServer`, CURVE-keyed with the cluster secret) and publishes a `Plan` there: a
   session id, the layout, and the broadcast queue's handle;
2. starts its own ranks as `MultiprocExecutor` does (shared memory, ipc stage links), joining
   torch.distributed through that store;
3. waits for every other rank's `RankInfo` (its pid, host and reply queue: a tcp XPUB on its
   node) in the store; a node that does not come within TREADLE_ENGINE_READY_TIMEOUT_S is an
   error naming the node and its ranks, and a node that runs another layout says so there;
4. then serves as `MultiprocExecutor`: the broadcast reaches the other nodes over its tcp
   XPUB, their replies come back over theirs.

The store's protocol (keys, `Plan`, `RankInfo`, sealing) is `rendezvous.py`; the other nodes'
side is `remote_node.py`.

Node R > 0 (`... --node-rank R --headless`): `run_node` waits for a plan whose session it has
not served yet, checks its layout against its own flags, starts its ranks (`run_remote_rank`),
and when they end (the engine core stopped or died, or one of them died) it kills what is
left of them and waits for the next engine core: the front end restarts a dead engine core,
whose new session the node joins.

Liveness: each remote rank adds to a heartbeat counter in the store every `BEAT_S`; the
engine core takes a rank whose counter stands still for TREADLE_NODE_HEARTBEAT_TIMEOUT_S as
dead (the engine-death path: the front end restarts it and requests resume); a rank that
whose store calls go unanswered for `CALL_REPLY_S` (the engine core is gone) exits.

Trust: what travels through the store is msgpack (`Plan`, `RankInfo`), never pickle; with a
cluster secret the store's socket is a CURVE server (a peer without the secret cannot read
or write a key, and is logged), each value also carries an HMAC, and every socket whose
address came from the store is CURVE-keyed. gloo's own connections (tensors, never code) are
not authenticated: anyone who reaches them could disturb a step. So a non-loopback
`--master-addr` without a secret is refused at start-up unless `--insecure-cluster`
(`ParallelConfig.check_nodes`), and the nodes belong on a network only they reach.
"""

from __future__ import annotations

import threading
import time
import uuid

import psutil

from treadle import envs
from treadle.config import EngineConfig
from treadle.executor.multiproc import MultiprocExecutor
from treadle.executor.remote_node import run_node  # (`cli/supervise.py` imports it here)
from treadle.executor.rendezvous import (
    BEAT_S,
    PLAN_KEY,
    POLL_S,
    Plan,
    RankInfo,
    beat_key,
    client,
    error_key,
    node_ip,
    put,
    rank_key,
    seal,
    unseal,
)
from treadle.ipc.process import (
    get_mp_context,
    start_process,
    wait_for_ready,
)
from treadle.ipc.secure_store import SecureStore, StoreServer
from treadle.ipc.shm_broadcast import MessageQueue
from treadle.ipc.zmq_utils import get_open_zmq_ipc_path
from treadle.logger import init_logger
from treadle.wire.topology import ProcessInfo, worker_title
from treadle.wire.worker import call_codec, reader_codec
from treadle.worker.worker_proc import run_worker

__all__ = ["MultinodeExecutor", "run_node"]

logger = init_logger(__name__)


_MARGIN_S = 5.0


class MultinodeExecutor(MultiprocExecutor):
    """`MultiprocExecutor` whose ranks span --nnodes hosts (module docstring)."""

    _server: StoreServer | None = None
    _store: SecureStore | None = None
    _watcher: threading.Thread | None = None

    def _start(self, config: EngineConfig) -> None:
        p = config.parallel
        self._closing = threading.Event()
        self.nnodes, self.master = p.nnodes, (p.master_addr, int(p.master_port or 0))
        self.local_ranks = list(p.node_ranks(0))
        self.session = uuid.uuid4().hex[:12]
        self.remote: dict[int, RankInfo] = {}
        self.stage_addresses = [
            get_open_zmq_ipc_path() if self.pp_size > 1 and self.tp_size <= r else None
            for r in self.local_ranks
        ] + [None] * (self.world_size - len(self.local_ranks))
        self.broadcast = MessageQueue(
            self.world_size,
            n_local_reader=len(self.local_ranks),
            local_reader_ranks=self.local_ranks,
            max_chunk_bytes=envs.mq_max_chunk_bytes(),
            connect_ip=node_ip(p.master_addr),
            codec=call_codec(cross_host=len(self.local_ranks) < self.world_size),
        )
        self._meet(config)

    def _watch_ranks(self) -> None:
        super()._watch_ranks()  # this node's processes
        self._watcher = threading.Thread(target=self._watch, name="node-beats", daemon=True)
        self._watcher.start()

    def _meet(self, config: EngineConfig) -> None:
        """Serve the rendezvous, start this node's ranks, wait for every node's."""
        host, port = self.master
        try:
            self._server = StoreServer(host, port)  # that address only; CURVE with the secret
        except OSError as e:
            raise RuntimeError(
                f"cannot listen on --master-addr {host} --master-port {port}: {e}"
            ) from None
        self._store = client(host, port)
        plan = Plan(
            session=self.session,
            nnodes=self.nnodes,
            tp=self.tp_size,
            pp=self.pp_size,
            broadcast=self.broadcast.export_handle(),
        )
        put(self._store, PLAN_KEY, seal(plan))
        # The front end gives this process's whole start TREADLE_ENGINE_READY_TIMEOUT_S: a
        # missing node is named here, a few seconds before that runs out.
        started = psutil.Process().create_time()
        timeout = max(1.0, envs.engine_ready_timeout_s() - (time.time() - started) - _MARGIN_S)
        deadline = time.monotonic() + timeout
        handle = self.broadcast.export_handle()
        stages = self.stage_addresses if self.pp_size > 1 else None
        ctx = get_mp_context()
        for rank in self.local_ranks:
            self.workers.append(
                start_process(
                    run_worker,
                    worker_title(rank, self.tp_size, self.pp_size),
                    args=(config, rank, self.world_size, handle, self.master, stages),
                    ctx=ctx,
                )
            )
        logger.info(
            "Ranks %s here; ranks %s on %d other node(s) meet at %s:%d",
            self.local_ranks,
            list(range(len(self.local_ranks), self.world_size)),
            self.nnodes - 1,
            host,
            port,
        )
        self._await_nodes(deadline, timeout)
        local = wait_for_ready(self.workers, timeout=max(1.0, deadline - time.monotonic()))
        remote = [self.remote[r].replies for r in range(len(self.local_ranks), self.world_size)]
        self.reply_handles = [*local, *remote]
        self.reply_queues = [
            MessageQueue.create_from_handle(h, 0, reader_codec(h.codec)) for h in self.reply_handles
        ]
        self.broadcast.wait_until_ready(timeout=60)
        for queue in self.reply_queues:
            queue.wait_until_ready(timeout=60)
        logger.info(
            "Nodes ready: %s",
            ", ".join(
                f"{self._title(r)} on {i.host} (pid {i.pid})" for r, i in self.remote.items()
            ),
        )

    def _await_nodes(self, deadline: float, timeout: float) -> None:
        """Every remote rank's `RankInfo`; a node that reports a problem fails the start at
        once, one that does not come by `deadline` is named."""
        assert self._store is not None
        k = len(self.local_ranks)
        missing = set(range(k, self.world_size))
        while missing:
            for node in range(1, self.nnodes):
                key = error_key(self.session, node)
                if self._store.check([key]):
                    raise ValueError(unseal(self._store.get(key), str, f"node {node}'s report"))
            for rank in sorted(missing):
                key = rank_key(self.session, rank)
                if self._store.check([key]):
                    what = f"{self._title(rank)}'s address"
                    self.remote[rank] = unseal(self._store.get(key), RankInfo, what)
                    missing.discard(rank)
            for w in self.workers:
                if w.exitcode is not None:
                    raise RuntimeError(f"{w.describe()} died while the nodes joined")
            if missing and time.monotonic() > deadline:
                nodes = sorted({r // k for r in missing})
                raise TimeoutError(
                    f"node(s) {', '.join(map(str, nodes))} did not join in {timeout:.0f} s "
                    f"(TREADLE_ENGINE_READY_TIMEOUT_S): rank(s) {sorted(missing)} "
                    f"({', '.join(self._title(r) for r in sorted(missing))}) are missing; is "
                    f"`treadle serve ... --nnodes {self.nnodes} --node-rank "
                    f"{nodes[0]} --master-addr {self.master[0]} --master-port {self.master[1]} "
                    "--headless` running there, and can it reach that address?"
                )
            if missing:
                time.sleep(POLL_S)

    def _title(self, rank: int) -> str:
        return worker_title(rank, self.tp_size, self.pp_size)

    def describe_rank(self, rank: int) -> str:
        info = self.remote[rank]
        node = rank // len(self.local_ranks)
        return f"{self._title(rank)} (pid {info.pid} on node {node} at {info.host})"

    # -- liveness -------------------------------------------------------------------------

    def _watch(self) -> None:
        """Read the remote ranks' heartbeats; one that stands still too long is a death."""
        assert self._store is not None
        limit = envs.node_heartbeat_timeout_s()
        seen = {r: (-1, time.monotonic()) for r in self.remote}
        while not self._closing.wait(BEAT_S):
            for rank, (count, since) in seen.items():
                try:
                    now_count = self._store.add(beat_key(self.session, rank), 0)
                except Exception:  # (the store is closing)
                    return
                now = time.monotonic()
                if now_count != count:
                    seen[rank] = (now_count, now)
                elif now - since > limit and not self._closing.is_set():
                    self._remote_died(rank, f"no heartbeat for {now - since:.1f} s")
                    return

    def _remote_died(self, rank: int, how: str) -> None:
        self.failure = f"{self.describe_rank(rank)} died: {how}"
        for queue in self.reply_queues:
            queue.shutdown()  # wakes a collective_rpc that waits for a reply
        if self.failure_callback is not None:
            self.failure_callback(self.failure, False)

    def _dead_workers(self) -> list[str]:
        dead = super()._dead_workers()
        if self.failure is not None and not self.stopped and self.failure not in dead:
            dead.append(self.failure)
        return dead

    def worker_processes(self) -> list[ProcessInfo]:
        """This node's ranks as psutil sees them, the others as they reported themselves."""
        infos = super().worker_processes()
        for rank, info in sorted(self.remote.items()):
            dead = self.failure is not None and self.failure.startswith(self.describe_rank(rank))
            infos.append(
                ProcessInfo(
                    title=self._title(rank),
                    pid=info.pid,
                    host=info.host,
                    ppid=info.ppid,
                    status="dead" if dead else "",
                )
            )
        return infos

    def shutdown(self) -> None:
        self._closing.set()  # (set first thing in `_start`)
        if self.monitor is None:  # a failed start: its ranks wait in a rendezvous, end them now
            for worker in self.workers:
                if worker.process.is_alive():
                    worker.process.kill()
        super().shutdown()
        if self._watcher is not None:
            self._watcher.join(timeout=2.0)
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._server is not None:
            self._server.close()  # the other nodes' ranks see it go
            self._server = None
