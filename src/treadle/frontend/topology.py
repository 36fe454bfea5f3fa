"""`GET /topology`: every process of the deployment, the channels between them, and each
engine's load, as one JSON document.

Two sources, merged by (host, pid):

- this host's front end, read with psutil: the process tree under the supervisor (several
  API servers) or under this API server (one), i.e. the API servers, the supervisor, the DP
  coordinator and the local engine cores and workers;
- each engine core's `get_topology` utility call (`core/engine_report.py`), over the usual
  request socket: its process, its workers, the `--headless` CLI that started it (so another
  host appears), the endpoints it holds, its shared-memory queues and its load.

`build_topology` is a pure function of those inputs (tests feed it made-up ones); `collect`
gathers them through `Engines`, the little this module and the dashboard need of the API
server's engine client (`AsyncLLM` is one). A process's id in `channels` is `"host:pid"`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from treadle.frontend.engine_state import ShownState
from treadle.ipc.proc_info import host_name, parent_title, parse_title, process_info, treadle_tree
from treadle.logger import init_logger
from treadle.wire.topology import EngineReport, ProcessInfo, QueueInfo

logger = init_logger(__name__)

REPORT_TIMEOUT_S = 3.0
"""An engine answers between two steps; one that takes longer is reported without details."""

STATES = tuple(ShownState)
"""What `/topology` shows of an engine and its processes."""


class Engines(Protocol):
    """What `/topology` and the dashboard read of this API server's engines."""

    @property
    def client_index(self) -> int: ...

    def shown_states(self) -> list[ShownState]:
        """Per DP rank, one of STATES (never "starting": the engine's processes are)."""
        ...

    def last_deaths(self) -> list[dict[str, Any] | None]:
        """Per DP rank, its last death as JSON (`Death.to_json`), or None."""
        ...

    def event_counts(self) -> dict[str, int]:
        """The supervisor's engine events this API server applied, by kind
        (`engine_events.py`; none with one API server)."""
        ...

    async def topology_report(self, rank: int) -> Any:
        """The engine's answer to `get_topology` (raises if it cannot answer)."""
        ...

    def coordinator_address(self) -> str:
        """The DP coordinator's XPUB that the API servers SUB to ("" without one)."""
        ...


@dataclass
class FrontEnd:
    """What this API server knows of itself."""

    pid: int
    host: str
    client_index: int
    local: list[ProcessInfo]  # this host's treadle processes (psutil)
    engine_states: list[ShownState]  # per DP rank, one of STATES
    coordinator_front: str = ""  # the coordinator's XPUB that the API servers SUB to
    last_deaths: list[dict[str, Any] | None] = field(default_factory=list)  # per DP rank
    events: dict[str, int] = field(default_factory=dict)  # the supervisor's, applied here


def node_id(p: ProcessInfo) -> str:
    return f"{p.host}:{p.pid}"


async def engine_reports(
    engines: Engines, states: Sequence[ShownState]
) -> list[EngineReport | None]:
    """Every engine's `get_topology` answer (None for one that is down or does not answer
    within REPORT_TIMEOUT_S)."""

    async def one(rank: int) -> EngineReport | None:
        if states[rank] in (ShownState.RESTARTING, ShownState.DEAD, ShownState.LOST):
            return None
        try:
            raw = await asyncio.wait_for(engines.topology_report(rank), REPORT_TIMEOUT_S)
            return msgspec.convert(raw, EngineReport)
        except Exception as e:  # dead, restarting or busy: reported as such
            logger.debug("No topology report from engine core %d: %r", rank, e)
            return None

    return list(await asyncio.gather(*(one(r) for r in range(len(states)))))


def local_processes(client_index: int) -> list[ProcessInfo]:
    """This host's front-end processes (psutil: a scan of the host's processes, so callers
    in the event loop run it in a thread)."""
    me = os.getpid()
    parent, parent_name = parent_title()
    root = parent if parent_name == "APIServerSupervisor" else me
    local = treadle_tree(root)
    if not any(p.pid == me for p in local):  # not titled (the library in a test): still here
        info = process_info(me, f"APIServer_{client_index}")
        if info is not None:
            local.insert(0, info)
    return local


async def front_end(engines: Engines) -> FrontEnd:
    local = await asyncio.to_thread(local_processes, engines.client_index)
    return FrontEnd(
        pid=os.getpid(),
        host=host_name(),
        client_index=engines.client_index,
        local=local,
        engine_states=engines.shown_states(),
        coordinator_front=engines.coordinator_address(),
        last_deaths=engines.last_deaths(),
        events=engines.event_counts(),
    )


async def collect(engines: Engines) -> dict[str, Any]:
    fe = await front_end(engines)
    reports = await engine_reports(engines, fe.engine_states)
    return build_topology(fe, reports)


# -- assembling ------------------------------------------------------------------------------


def _process_entry(p: ProcessInfo, state: ShownState) -> dict[str, Any]:
    role, ranks = parse_title(p.title)
    entry: dict[str, Any] = {"id": node_id(p), "role": role, **msgspec.to_builtins(p)}
    entry.update(ranks)
    entry["state"] = ShownState.DEAD if p.status in ("zombie", "dead") else state
    return entry


def build_topology(fe: FrontEnd, reports: Sequence[EngineReport | None]) -> dict[str, Any]:
    """The `/topology` document from this API server's view and the engines' reports."""
    infos: dict[tuple[str, int], ProcessInfo] = {(p.host, p.pid): p for p in fe.local}
    reported_by: dict[str, int] = {}  # process id -> the DP rank whose engine reported it
    for rank, report in enumerate(reports):
        for p in report.processes if report else ():
            infos[(p.host, p.pid)] = p  # the engine's own look is the fresher one
            reported_by[node_id(p)] = rank
    processes = []
    for p in infos.values():
        role, ranks = parse_title(p.title)
        state = ShownState.READY
        if role in ("EngineCore", "Worker"):
            state = (
                ShownState.STARTING
            )  # until its engine is known: a new process, or one not answering
        processes.append(_process_entry(p, state))
    by_id = {e["id"]: e for e in processes}
    # Workers carry their engine's DP rank and state; engines their client-side state. A
    # worker on another host (`--nnodes`, Ray) has no engine core for a parent: the engine
    # that reported it is its engine.
    for e in processes:
        if e["role"] == "Worker":
            parent = by_id.get(f"{e['host']}:{e['ppid']}")
            if parent is not None and "dp_rank" in parent:
                e["dp_rank"] = parent["dp_rank"]
            elif e["id"] in reported_by:
                e["dp_rank"] = reported_by[e["id"]]
    engines = []
    for rank, state in enumerate(fe.engine_states):
        report = reports[rank] if rank < len(reports) else None
        # "starting" stays for a process of an engine that is up but sent no report.
        known = report is not None or state != ShownState.READY
        for e in processes:
            ours = e.get("dp_rank") == rank and e["role"] in ("EngineCore", "Worker")
            if ours and known and e["state"] != ShownState.DEAD:
                e["state"] = state
        entry = engine_entry(rank, state, report)
        if rank < len(fe.last_deaths) and fe.last_deaths[rank] is not None:
            entry["last_death"] = fe.last_deaths[rank]
        engines.append(entry)
    me = by_id.get(f"{fe.host}:{fe.pid}")
    if me is not None and ShownState.DEAD in fe.engine_states:
        me["state"] = ShownState.DEAD
    processes.sort(key=_order)
    return {
        "time": time.time(),
        "served_by": {"host": fe.host, "pid": fe.pid, "api_server": fe.client_index},
        "events": fe.events,
        "hosts": sorted({p["host"] for p in processes}),
        "processes": processes,
        "channels": _channels(fe, processes, reports),
        "engines": engines,
    }


_ROLE_ORDER = ["APIServerSupervisor", "APIServer", "DPCoordinator", "Headless", "EngineCore"]


def _order(e: dict[str, Any]) -> tuple[Any, ...]:
    role = e["role"]
    rank = _ROLE_ORDER.index(role) if role in _ROLE_ORDER else len(_ROLE_ORDER)
    return (e.get("dp_rank", -1), rank, e.get("tp_rank", -1), e.get("api_server", -1), e["pid"])


def engine_entry(rank: int, state: ShownState, report: EngineReport | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"dp_rank": rank, "state": state}
    if report is None:
        entry["error"] = (
            "no report" if state == ShownState.READY else f"engine core {rank} is {state}"
        )
        return entry
    core = report.processes[0]
    stats = report.stats
    queries = stats.prefix_cache_queries
    entry.update(
        host=core.host,
        pid=core.pid,
        tp_size=max(1, len(report.worker_replies)),
        running=stats.num_running_reqs,
        waiting=stats.num_waiting_reqs,
        kv_used_blocks=report.used_blocks,
        kv_total_blocks=report.num_blocks,
        kv_usage=stats.kv_cache_usage,
        block_size=report.block_size,
        prefix_cache_queries=queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        prefix_cache_hit_rate=stats.prefix_cache_hits / queries if queries else 0.0,
        num_preemptions=stats.num_preemptions,
        spec_decode_num_draft_tokens=stats.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens=stats.spec_decode_num_accepted_tokens,
        spec_decode_acceptance_rate=stats.spec_decode_num_accepted_tokens
        / stats.spec_decode_num_draft_tokens
        if stats.spec_decode_num_draft_tokens
        else None,
        images_encoded=stats.mm_images_encoded,
        encoder_cache_hits=stats.mm_encoder_cache_hits,
        encoder_seconds=stats.mm_encoder_seconds,
        steps=report.steps,
        generated_tokens=report.generated_tokens,
        steps_per_s=report.steps_per_s,
        scheduled_tokens_per_s=report.scheduled_tokens_per_s,
        generated_tokens_per_s=report.generated_tokens_per_s,
    )
    return entry


def _zmq(kind: str, src: str, dst: str, sockets: str, address: str, binds: str) -> dict[str, Any]:
    src_socket, dst_socket = sockets.split("->")
    return {
        "kind": kind,
        "transport": "zmq",
        "from": src,
        "to": [dst],
        "from_socket": src_socket,
        "to_socket": dst_socket,
        "address": address,
        "bound_by": binds,
    }


def _channels(
    fe: FrontEnd, processes: list[dict[str, Any]], reports: Sequence[EngineReport | None]
) -> list[dict[str, Any]]:
    api = {e["api_server"]: e["id"] for e in processes if e["role"] == "APIServer"}
    coordinator = next((e["id"] for e in processes if e["role"] == "DPCoordinator"), None)
    out: list[dict[str, Any]] = []
    if coordinator is not None and fe.coordinator_front:
        out.append(
            {
                **_zmq("dp_load", coordinator, "", "XPUB->SUB", fe.coordinator_front, "from"),
                "to": [api[i] for i in sorted(api)],
            }
        )
    for report in reports:
        if report is None:
            continue
        engine = node_id(report.processes[0])
        ch = report.channels
        for i, addr in enumerate(ch.inputs):
            if i in api:
                out.append(_zmq("requests", api[i], engine, "ROUTER->DEALER", addr, "from"))
        for i, addr in enumerate(ch.outputs):
            if i in api:
                out.append(_zmq("outputs", engine, api[i], "PUSH->PULL", addr, "to"))
        if coordinator is not None and ch.coordinator_output:
            out.append(
                _zmq("dp_stats", engine, coordinator, "PUSH->PULL", ch.coordinator_output, "to")
            )
        if coordinator is not None and ch.coordinator_input:
            out.append(
                _zmq("dp_wave", coordinator, engine, "XPUB->XSUB", ch.coordinator_input, "from")
            )
        workers = [node_id(p) for p in report.processes if parse_title(p.title)[0] == "Worker"]
        if report.broadcast is not None and workers:
            out.append(_shm("shm_broadcast", engine, workers, report.broadcast))
        for worker, queue in zip(workers, report.worker_replies, strict=False):
            out.append(_shm("worker_results", worker, [engine], queue))
        if report.collective_backend and len(workers) > 1:
            out.append(
                {
                    "kind": "tp_collectives",
                    "transport": report.collective_backend,
                    "from": workers[0],
                    "to": workers[1:],
                }
            )
    return out


def _shm(kind: str, src: str, dst: list[str], queue: QueueInfo) -> dict[str, Any]:
    return {
        "kind": kind,
        "transport": "shm",
        "from": src,
        "to": dst,
        "address": queue.name,
        "chunks": queue.chunks,
        "chunk_bytes": queue.chunk_bytes,
        "readers": queue.readers,
        "overflow_address": queue.overflow_address,
        "notify_address": queue.notify_address,
    }
