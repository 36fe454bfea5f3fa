"""`build_topology` on made-up inputs: a front-end host with a supervisor, two API servers,
the DP coordinator and a TP=2 engine, plus a second host whose --headless CLI started
engine 1."""

from __future__ import annotations

from typing import Any

from treadle.frontend.engine_state import Death
from treadle.frontend.topology import FrontEnd, build_topology
from treadle.wire.control import DeathReport
from treadle.wire.engine import SchedulerStats
from treadle.wire.topology import EngineChannels, EngineReport, ProcessInfo, QueueInfo


def proc(title: str, pid: int, ppid: int, host: str = "front", **kw: Any) -> ProcessInfo:
    return ProcessInfo(title=title, pid=pid, host=host, ppid=ppid, status="sleeping", **kw)


LOCAL = [
    proc("APIServerSupervisor", 100, 1),
    proc("APIServer_0", 101, 100),
    proc("APIServer_1", 102, 100),
    proc("DPCoordinator", 103, 100),
    proc("EngineCore_DP0", 104, 100),
    proc("Worker_TP0", 105, 104),
    proc("Worker_TP1", 106, 104),
]


def queue(name: str, readers: int) -> QueueInfo:
    return QueueInfo(name=name, chunks=10, chunk_bytes=1 << 24, readers=readers)


def report0() -> EngineReport:
    return EngineReport(
        dp_rank=0,
        processes=[
            proc("EngineCore_DP0", 104, 100, cpu_percent=50.0),
            proc("Worker_TP0", 105, 104),
            proc("Worker_TP1", 106, 104),
        ],
        channels=EngineChannels(
            inputs=["tcp://f:1", "tcp://f:2"],
            outputs=["tcp://f:3", "tcp://f:4"],
            coordinator_input="tcp://f:5",
            coordinator_output="tcp://f:6",
        ),
        broadcast=queue("treadle_b", 2),
        worker_replies=[queue("treadle_r0", 1), queue("treadle_r1", 1)],
        collective_backend="gloo",
        num_blocks=100,
        used_blocks=25,
        block_size=16,
        stats=SchedulerStats(2, 1, 0.25, prefix_cache_queries=40, prefix_cache_hits=10),
        steps_per_s=12.5,
        generated_tokens_per_s=25.0,
    )


def report1() -> EngineReport:
    return EngineReport(
        dp_rank=1,
        processes=[proc("EngineCore_DP1", 200, 199, host="back"), proc("Headless", 199, 5, "back")],
        channels=EngineChannels(
            inputs=["tcp://f:1", "tcp://f:2"],
            outputs=["tcp://f:3", "tcp://f:4"],
            coordinator_input="tcp://f:5",
            coordinator_output="tcp://f:6",
        ),
        num_blocks=100,
    )


def front(states: list[str]) -> FrontEnd:
    return FrontEnd(
        pid=101,
        host="front",
        client_index=0,
        local=list(LOCAL),
        engine_states=states,
        coordinator_front="tcp://f:7",
    )


def by_title(topology: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(p["host"], p["title"]): p for p in topology["processes"]}


def test_every_process_once_with_its_role_ranks_and_state() -> None:
    topo = build_topology(front(["ready", "ready"]), [report0(), report1()])
    procs = by_title(topo)
    assert len(topo["processes"]) == 9 and len(procs) == 9
    assert topo["hosts"] == ["back", "front"]
    assert topo["served_by"] == {"host": "front", "pid": 101, "api_server": 0}
    assert procs[("front", "APIServerSupervisor")]["role"] == "APIServerSupervisor"
    assert procs[("front", "APIServer_1")]["api_server"] == 1
    assert procs[("front", "EngineCore_DP0")]["cpu_percent"] == 50.0  # the engine's own look
    worker = procs[("front", "Worker_TP1")]
    assert (worker["role"], worker["tp_rank"], worker["dp_rank"]) == ("Worker", 1, 0)
    assert procs[("back", "EngineCore_DP1")]["dp_rank"] == 1
    assert procs[("back", "Headless")]["role"] == "Headless"
    assert {p["state"] for p in topo["processes"]} == {"ready"}
    assert procs[("front", "Worker_TP0")]["id"] == "front:105"


def test_channels_join_the_engines_endpoints_to_the_api_servers() -> None:
    topo = build_topology(front(["ready", "ready"]), [report0(), report1()])
    kinds: dict[str, list[dict[str, Any]]] = {}
    for c in topo["channels"]:
        kinds.setdefault(c["kind"], []).append(c)
    assert {k: len(v) for k, v in kinds.items()} == {
        "dp_load": 1,
        "requests": 4,
        "outputs": 4,
        "dp_stats": 2,
        "dp_wave": 2,
        "shm_broadcast": 1,
        "worker_results": 2,
        "tp_collectives": 1,
    }
    requests = {(c["from"], c["to"][0]): c["address"] for c in kinds["requests"]}
    assert requests == {
        ("front:101", "front:104"): "tcp://f:1",
        ("front:102", "front:104"): "tcp://f:2",
        ("front:101", "back:200"): "tcp://f:1",
        ("front:102", "back:200"): "tcp://f:2",
    }
    out = next(c for c in kinds["outputs"] if c["to"] == ["front:102"] and c["from"] == "back:200")
    assert (out["from_socket"], out["to_socket"], out["address"]) == ("PUSH", "PULL", "tcp://f:4")
    assert out["bound_by"] == "to"
    assert kinds["dp_load"][0]["to"] == ["front:101", "front:102"]
    assert kinds["dp_load"][0]["from"] == "front:103"
    shm = kinds["shm_broadcast"][0]
    assert (shm["from"], shm["to"], shm["readers"]) == ("front:104", ["front:105", "front:106"], 2)
    replies = {(c["from"], c["address"]) for c in kinds["worker_results"]}
    assert replies == {("front:105", "treadle_r0"), ("front:106", "treadle_r1")}


def test_engine_entries_carry_the_load() -> None:
    engines = build_topology(front(["ready", "ready"]), [report0(), report1()])["engines"]
    e0 = engines[0]
    assert (e0["running"], e0["waiting"], e0["kv_used_blocks"], e0["kv_total_blocks"]) == (
        2,
        1,
        25,
        100,
    )
    assert e0["prefix_cache_hit_rate"] == 0.25 and e0["tp_size"] == 2
    assert (e0["steps_per_s"], e0["generated_tokens_per_s"]) == (12.5, 25.0)
    assert (engines[1]["host"], engines[1]["pid"], engines[1]["tp_size"]) == ("back", 200, 1)


def test_an_engine_entry_carries_its_last_death() -> None:
    report = DeathReport(0, "RuntimeError: boom", ["engine_core.py:210 in step"], ["INFO hi"])
    death = Death("the EngineCore_DP0 process died: exit code 1", report, time=5.0)
    fe = front(["ready", "ready"])
    fe.last_deaths = [death.to_json(), None]
    engines = build_topology(fe, [report0(), report1()])["engines"]
    assert engines[0]["last_death"] == {
        "time": 5.0,
        "cause": "the EngineCore_DP0 process died: exit code 1",
        "error": "RuntimeError: boom",
        "frames": ["engine_core.py:210 in step"],
        "log_tail": ["INFO hi"],
    }
    assert "last_death" not in engines[1]
    assert death.describe() == (
        "the EngineCore_DP0 process died: exit code 1; it raised RuntimeError: boom "
        "(at engine_core.py:210 in step)"
    )


def test_a_restarting_engine_and_one_that_does_not_answer() -> None:
    topo = build_topology(front(["stalled", "restarting"]), [report0(), None])
    procs = by_title(topo)
    assert procs[("front", "EngineCore_DP0")]["state"] == "stalled"
    assert procs[("front", "Worker_TP1")]["state"] == "stalled"
    assert ("back", "EngineCore_DP1") not in procs  # its host reports through it alone
    assert topo["engines"][1] == {
        "dp_rank": 1,
        "state": "restarting",
        "error": "engine core 1 is restarting",
    }
    assert not any("back:200" in (c["from"], *c["to"]) for c in topo["channels"])

    silent = build_topology(front(["ready", "ready"]), [None, report1()])
    procs = by_title(silent)
    assert procs[("front", "EngineCore_DP0")]["state"] == "starting"
    assert procs[("front", "Worker_TP0")]["state"] == "starting"
    assert procs[("back", "EngineCore_DP1")]["state"] == "ready"


def test_a_zombie_is_dead_and_a_dead_client_is_dead_everywhere() -> None:
    fe = front(["ready", "ready"])
    fe.local[3] = proc("DPCoordinator", 103, 100)
    fe.local[3].status = "zombie"
    topo = build_topology(fe, [report0(), report1()])
    assert by_title(topo)[("front", "DPCoordinator")]["state"] == "dead"

    topo = build_topology(front(["dead", "dead"]), [None, None])
    procs = by_title(topo)
    assert procs[("front", "APIServer_0")]["state"] == "dead"
    assert procs[("front", "EngineCore_DP0")]["state"] == "dead"
    assert [e["state"] for e in topo["engines"]] == ["dead", "dead"]


def test_a_worker_on_another_host_takes_the_state_of_the_engine_that_reported_it() -> None:
    """`--nnodes` / Ray: rank 1's parent is `Node_1` (or a raylet) on another host, not the
    engine core; the engine that reports it is its engine."""
    report = report0()
    report.processes[2] = proc("Worker_TP1", 300, 299, host="node1")
    local = [p for p in LOCAL if p.title != "Worker_TP1"]
    fe = front(["ready", "ready"])
    fe.local = local
    topo = build_topology(fe, [report, report1()])
    remote = by_title(topo)[("node1", "Worker_TP1")]
    assert (remote["dp_rank"], remote["state"]) == (0, "ready")
    topo = build_topology(fe, [None, report1()])  # engine 0 sent no report: nothing known
    assert ("node1", "Worker_TP1") not in by_title(topo)
