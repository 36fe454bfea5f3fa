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

import contextlib
import hashlib
import hmac
import os
import signal
import socket
import threading
import time
import uuid
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import msgspec
import psutil
import torch.distributed as dist

from treadle import envs
from treadle.config import EngineConfig
from treadle.executor.multiproc import MultiprocExecutor
from treadle.ipc import cluster_auth
from treadle.ipc.proc_info import host_name
from treadle.ipc.process import (
    ReadyPipe,
    get_mp_context,
    shutdown_processes,
    start_process,
    wait_for_ready,
)
from treadle.ipc.secure_store import SecureStore, StoreServer
from treadle.ipc.shm_broadcast import Handle, MessageQueue
from treadle.ipc.zmq_utils import get_open_zmq_ipc_path, get_tcp_uri, remove_ipc_files
from treadle.logger import init_logger
from treadle.wire.topology import ProcessInfo
from treadle.wire.worker import call_codec, reader_codec, reply_codec
from treadle.worker.worker_proc import busy_loop, run_worker, start_worker, worker_title

logger = init_logger(__name__)

BEAT_S = 0.5
"""A remote rank's heartbeat period."""
CALL_REPLY_S = 5.0
"""A store call that node 0's store does not answer in this long fails: the engine core is
gone."""
_PLAN = "treadle/nodes/plan"
_POLL_S = 0.2
_MARGIN_S = 5.0


class Plan(msgspec.Struct, kw_only=True):
    """What the engine core publishes for the other nodes."""

    session: str  # one per engine core: a node serves each session once
    nnodes: int
    tp: int
    pp: int
    broadcast: Handle


class RankInfo(msgspec.Struct, kw_only=True):
    """What a remote rank publishes once loaded."""

    pid: int
    ppid: int
    host: str
    replies: Handle


def _rank_key(session: str, rank: int) -> str:
    return f"treadle/nodes/{session}/rank/{rank}"


def _beat_key(session: str, rank: int) -> str:
    return f"treadle/nodes/{session}/beat/{rank}"


def _error_key(session: str, node: int) -> str:
    return f"treadle/nodes/{session}/error/{node}"


def _node_key(session: str, node: int) -> str:
    return f"treadle/nodes/{session}/node/{node}"


# -- sealed values ---------------------------------------------------------------------------


def _mac_key() -> bytes | None:
    keys = cluster_auth.cluster_keys()
    return None if keys is None else hashlib.blake2b(keys.client_secret, person=b"nodes").digest()


def seal(obj: Any) -> bytes:
    """msgpack, behind an HMAC of the cluster secret when there is one."""
    data = msgspec.msgpack.encode(obj)
    key = _mac_key()
    if key is None:
        return b"T0" + data
    return b"T1" + hmac.new(key, data, "sha256").digest() + data


def unseal(raw: bytes, kind: type[Any], what: str) -> Any:
    """The value `seal` made; `ValueError` saying why it is refused."""
    key = _mac_key()
    if raw[:2] == b"T1" and key is not None:
        tag, data = raw[2:34], raw[34:]
        if not hmac.compare_digest(tag, hmac.new(key, data, "sha256").digest()):
            raise ValueError(f"{what} is not sealed with this cluster's secret")
    elif raw[:2] == b"T0" and key is None:
        data = raw[2:]
    elif raw[:2] in (b"T0", b"T1"):
        sides = "the other side has a cluster secret and this one has none"
        if key is not None:
            sides = "this side has a cluster secret and the other has none"
        raise ValueError(f"{what}: {sides} (give every node the same --cluster-secret-file)")
    else:
        raise ValueError(f"{what} is not a treadle value")
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except msgspec.ValidationError as e:
        raise ValueError(f"{what} is malformed: {e}") from None


# -- addresses and the store -----------------------------------------------------------------


def node_ip(master_addr: str) -> str:
    """This node's address as the others reach it: TREADLE_HOST_IP, else the interface that
    routes to the master (no packet is sent)."""
    chosen = envs.host_ip()
    if chosen is not None:
        return chosen
    family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))
            return str(s.getsockname()[0])
    except OSError:
        return master_addr


def _put(store: dist.Store, key: str, value: bytes) -> None:
    store.set(key, value)  # type: ignore[arg-type]  # (bytes are stored as they are)


def _client(host: str, port: int) -> SecureStore:
    """A client of node 0's store; a call that the store does not answer in 5 s fails (the
    engine core is gone)."""
    return SecureStore(host, port, timeout=timedelta(seconds=30), reply_s=CALL_REPLY_S)


# -- node 0: the executor ----------------------------------------------------------------------


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
        self._store = _client(host, port)
        plan = Plan(
            session=self.session,
            nnodes=self.nnodes,
            tp=self.tp_size,
            pp=self.pp_size,
            broadcast=self.broadcast.export_handle(),
        )
        _put(self._store, _PLAN, seal(plan))
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
                key = _error_key(self.session, node)
                if self._store.check([key]):
                    raise ValueError(unseal(self._store.get(key), str, f"node {node}'s report"))
            for rank in sorted(missing):
                key = _rank_key(self.session, rank)
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
                time.sleep(_POLL_S)

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
                    now_count = self._store.add(_beat_key(self.session, rank), 0)
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


# -- nodes 1..N-1 ----------------------------------------------------------------------------


def run_node(config: EngineConfig, stop: threading.Event) -> int:
    """A headless node's loop: serve each engine core's session with this node's ranks, until
    `stop`. Returns the exit status (2: this node's flags do not match the engine core's)."""
    p = config.parallel
    host, port = p.master_addr, int(p.master_port or 0)
    ranks = list(p.node_ranks(p.node_rank))
    ip = node_ip(host)
    last: str | None = None
    ctx = get_mp_context()
    logger.info(
        "Node %d of %d at %s: ranks %s; the engine core is at %s:%d",
        p.node_rank,
        p.nnodes,
        ip,
        ranks,
        host,
        port,
    )
    while not stop.is_set():
        plan = _next_plan(host, port, last, stop)
        if plan is None:
            break
        last = plan.session
        problem = _mismatch(plan, config, host, port)
        if problem is None and not _claim(host, port, plan.session, p.node_rank):
            problem = f"another node already joined as --node-rank {p.node_rank}"
        if problem is not None:
            _report(host, port, plan.session, p.node_rank, problem)
            logger.error("%s", problem)
            return 2
        logger.info("Joining engine core session %s with ranks %s", plan.session, ranks)
        workers = [
            start_process(
                run_remote_rank,
                worker_title(r, p.tensor_parallel_size, p.pipeline_parallel_size),
                args=(config, r, plan.session, ip),
                ctx=ctx,
            )
            for r in ranks
        ]
        while not stop.is_set() and all(w.exitcode is None for w in workers):
            wait([w.sentinel for w in workers], timeout=0.5)
        for w in workers:
            if w.exitcode is not None:
                logger.info("%s ended (exit %s)", w.describe(), w.exitcode)
        # The others follow within moments (the store goes with the engine core); a rank
        # whose peer here died may still wait in a collective: end it.
        shutdown_processes(workers, timeout=2.0 if not stop.is_set() else 5.0)
    return 0


def _next_plan(host: str, port: int, last: str | None, stop: threading.Event) -> Plan | None:
    """The plan of an engine core session other than `last`, once one is published."""
    said = False
    while not stop.is_set():
        store = _client(host, port)
        try:
            if store.check([_PLAN]):
                plan: Plan = unseal(store.get(_PLAN), Plan, "the engine core's plan")
                if plan.session != last:
                    return plan
        except ValueError:
            raise
        except Exception as e:  # (no engine core there, or it went away meanwhile)
            logger.debug("store at %s:%d: %s", host, port, e)
        finally:
            store.close()
        if not said:
            logger.info("Waiting for the engine core at %s:%d", host, port)
            said = True
        stop.wait(1.0)
    return None


def _mismatch(plan: Plan, config: EngineConfig, host: str, port: int) -> str | None:
    p = config.parallel
    ours = (p.nnodes, p.tensor_parallel_size, p.pipeline_parallel_size)
    if ours == (plan.nnodes, plan.tp, plan.pp):
        return None
    return (
        f"node {p.node_rank} runs -tp {ours[1]} -pp {ours[2]} --nnodes {ours[0]}, but the "
        f"engine core at {host}:{port} runs -tp {plan.tp} -pp {plan.pp} --nnodes "
        f"{plan.nnodes}: give every node the same -tp, -pp and --nnodes"
    )


def _claim(host: str, port: int, session: str, node: int) -> bool:
    with contextlib.suppress(Exception):
        return int(_client(host, port).add(_node_key(session, node), 1)) == 1
    return True  # (the store went away: the next session decides)


def _report(host: str, port: int, session: str, node: int, problem: str) -> None:
    with contextlib.suppress(Exception):
        _put(_client(host, port), _error_key(session, node), seal(problem))


def run_remote_rank(
    ready: ReadyPipe, config: EngineConfig, rank: int, session: str, ip: str
) -> None:
    """Process entry of a rank on node R > 0: join the session's group through the store,
    link stages, load the shard, publish the reply queue, serve the broadcast over tcp."""
    p = config.parallel
    tp, pp = p.tensor_parallel_size, p.pipeline_parallel_size
    title = worker_title(rank, tp, pp)
    master = (p.master_addr, int(p.master_port or 0))
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    store = _client(*master)
    plan: Plan = unseal(store.get(_PLAN), Plan, "the engine core's plan")
    if plan.session != session:
        logger.info("%s: engine core session %s is over", title, session)
        return
    stage_addresses: list[str | None] | None = None
    if pp > 1:
        stage_addresses = [None] * p.world_size
        if rank >= tp:
            here = p.node_ranks(p.node_rank)
            sender_here = rank - tp in here
            stage_addresses[rank] = get_open_zmq_ipc_path() if sender_here else get_tcp_uri(ip, 0)
    own_files = [a for a in stage_addresses or [] if a is not None and a.startswith("ipc://")]
    _Heartbeat(master, session, rank, title, own_files).start()
    worker = start_worker(config, rank, p.world_size, master, stage_addresses)
    replies = MessageQueue(1, 0, connect_ip=ip, codec=reply_codec(cross_host=True))
    info = RankInfo(pid=os.getpid(), ppid=os.getppid(), host=host_name(), replies=replies.handle)
    _put(store, _rank_key(session, rank), seal(info))
    ready.send_ready(None)
    requests = MessageQueue.create_from_handle(
        plan.broadcast, rank, reader_codec(plan.broadcast.codec)
    )
    try:
        requests.wait_until_ready(timeout=120)
        replies.wait_until_ready(timeout=120)
        busy_loop(worker, rank, title, requests, replies)
    finally:
        requests.close()
        replies.close()
        if worker.link is not None:
            worker.link.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """The node is stopping (or ends what is left of a session): this rank alone cannot ask
    the engine core for anything, it just goes."""
    raise SystemExit(0)


class _Heartbeat(threading.Thread):
    """Adds to this rank's counter in the store every `BEAT_S`; when the store is gone (the
    engine core with it) the rank exits at once: whatever it waits for will never come."""

    def __init__(
        self, master: tuple[str, int], session: str, rank: int, title: str, files: list[str]
    ) -> None:
        super().__init__(name="node-heartbeat", daemon=True)
        self.store = _client(*master)
        self.key, self.title, self.files = _beat_key(session, rank), title, files

    def run(self) -> None:
        while True:
            try:
                self.store.add(self.key, 1)
            except Exception:
                logger.info("%s: the engine core is gone; exiting", self.title)
                remove_ipc_files(self.files)
                os._exit(0)
            time.sleep(BEAT_S)
