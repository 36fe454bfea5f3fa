"""The nodes 1..N-1 of `--nnodes` (`treadle serve M ... --node-rank R --headless`): `run_node`
serves each engine core's session with this node's ranks (`run_remote_rank`), which publish
their `RankInfo` and beat in the store until the engine core is gone. The protocol is
`rendezvous.py`; node 0's side `multinode.py` (whose docstring tells the whole story).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from multiprocessing.connection import wait
from typing import Any

import torch.distributed as dist

from treadle.config import EngineConfig
from treadle.executor.rendezvous import (
    BEAT_S,
    PLAN_KEY,
    Plan,
    RankInfo,
    beat_key,
    client,
    error_key,
    node_ip,
    node_key,
    put,
    rank_key,
    seal,
    unseal,
)
from treadle.ipc.proc_info import host_name
from treadle.ipc.process import (
    ReadyPipe,
    get_mp_context,
    shutdown_processes,
    start_process,
)
from treadle.ipc.shm_broadcast import MessageQueue
from treadle.ipc.zmq_utils import get_open_zmq_ipc_path, get_tcp_uri, remove_ipc_files
from treadle.logger import init_logger
from treadle.wire.topology import worker_title
from treadle.wire.worker import reader_codec, reply_codec
from treadle.worker.worker_proc import busy_loop, start_worker

logger = init_logger(__name__)


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
        store = client(host, port)
        try:
            if store.check([PLAN_KEY]):
                plan: Plan = unseal(store.get(PLAN_KEY), Plan, "the engine core's plan")
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
        return int(client(host, port).add(node_key(session, node), 1)) == 1
    return True  # (the store went away: the next session decides)


def _report(host: str, port: int, session: str, node: int, problem: str) -> None:
    with contextlib.suppress(Exception):
        put(client(host, port), error_key(session, node), seal(problem))


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
    store = client(*master)
    plan: Plan = unseal(store.get(PLAN_KEY), Plan, "the engine core's plan")
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
    put(store, rank_key(session, rank), seal(info))
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
        self.store = client(*master)
        self.key, self.title, self.files = beat_key(session, rank), title, files

    def run(self) -> None:
        while True:
            try:
                self.store.add(self.key, 1)
            except Exception:
                logger.info("%s: the engine core is gone; exiting", self.title)
                remove_ipc_files(self.files)
                os._exit(0)
            time.sleep(BEAT_S)
