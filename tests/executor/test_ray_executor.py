"""`--distributed-executor-backend ray` on two "hosts": one Ray cluster for the module, a head
node (this machine's address) and a node at 127.0.0.2, two CPUs each (logical: the machine may
have fewer), so that PACK spreads `-tp 2` with `--cpu-threads 2` (a bundle fills a node) as rank 0
on the head and rank 1 on 127.0.0.2, which reads the broadcast over tcp, and `-tp 2 -pp 2` with
`--cpu-threads 1` as stage 0 on the head and stage 1 on 127.0.0.2, linked by tcp. Every tcp
socket speaks CURVE: the module sets a cluster secret."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import json
import logging
import re
import signal
import subprocess
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from serve_helpers import TREADLE, RemoteServer, stream_text
from treadle import LLM, SamplingParams
from treadle.config import ParallelConfig
from treadle.engine_args import EngineArgs

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")

MAX_TOKENS = 48
# A dead node is seen in about a second, not Ray's default 15 s.
FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
SECOND_HOST = {"num_cpus": 2, "node_ip_address": "127.0.0.2"}
PROMPTS = [f"stream {i} says" for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _cluster_processes(cluster: Any) -> list[psutil.Process]:
    """The processes of the cluster's nodes (gcs_server, raylets, agents) and their
    descendants (Ray's workers, among them ours): those of this module only, not another
    test's on the same machine."""
    procs = []
    for node in cluster.list_all_nodes():
        for infos in node.all_processes.values():
            for info in infos:
                with contextlib.suppress(psutil.NoSuchProcess):
                    top = psutil.Process(info.process.pid)
                    procs += [top, *top.children(recursive=True)]
    return procs


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    seen: set[psutil.Process] = set()
    # A Ray node started here installs its own SIGTERM handler in this process (it kills the
    # node and exits 1) and leaves it there: put ours back afterwards, or every child forked
    # later by this test run exits 1 on SIGTERM instead of being killed by it.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TREADLE_CLUSTER_SECRET", "ray-executor-test-secret-0123456789")
        mp.setenv("TREADLE_RAY_PLACEMENT_TIMEOUT_S", "10")
        cluster = ray_cluster_utils.Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "include_dashboard": False,
                "_system_config": FAST_HEALTH,
            },
        )
        try:
            cluster.add_node(**SECOND_HOST)
            mp.setenv("RAY_ADDRESS", cluster.address)
            cluster.seen = seen  # the tests add what they saw
            yield cluster
        finally:
            seen.update(_cluster_processes(cluster))
            cluster.shutdown()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    _, alive = psutil.wait_procs(list(seen), timeout=10)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"Ray processes left: {[p.cmdline()[:2] for p in alive]}"


@pytest.fixture(scope="module")
def reference(tiny_model_factory) -> list[Any]:  # type: ignore[no-untyped-def]
    """One process's greedy outputs for PROMPTS."""
    single = LLM(str(tiny_model_factory("llama")), dtype="float32")
    try:
        return single.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        single.shutdown()


def _second_host(cluster: Any) -> Any:
    return next(n for n in cluster.list_all_nodes() if n.node_ip_address == "127.0.0.2")


def test_an_unknown_backend_is_refused_and_ray_missing_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args, warnings = EngineArgs.from_kwargs(distributed_executor_backend="ray")
    assert args.distributed_executor_backend == "ray" and warnings == []
    with pytest.raises(ValueError, match="--distributed-executor-backend 'nccl': choose one of"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="nccl").check()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a)
    )
    with pytest.raises(ValueError, match=r"pip install 'treadle\[ray\]'"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray").check()


def test_serve_refuses_an_unknown_backend_in_one_line() -> None:
    proc = subprocess.run(
        [TREADLE, "serve", "--distributed-executor-backend", "threads", "-tp", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "treadle serve: error: --distributed-executor-backend 'threads': choose one of mp, ray"
    ]


def _worker(cluster: Any, title: str) -> psutil.Process:
    procs = _cluster_processes(cluster)
    cluster.seen.update(procs)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.cmdline() and p.cmdline()[0].strip() == f"treadle::{title}":
                return p
    raise LookupError(title)


def test_the_secret_never_goes_into_an_actors_runtime_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """An actor's runtime_env shows in `ray list actors --detail` and the dashboard: the rank's
    TREADLE_* settings go there, the cluster secret goes to `RayWorker.start` instead."""
    from treadle.executor.ray_worker import actor_env

    monkeypatch.setenv("TREADLE_CLUSTER_SECRET", "s" * 32)
    monkeypatch.setenv("TREADLE_KV_CACHE_SPACE", "1")
    env = actor_env("127.0.0.2", 3)
    assert "TREADLE_CLUSTER_SECRET" not in env and "s" * 32 not in json.dumps(env)
    assert env["TREADLE_KV_CACHE_SPACE"] == "1"
    assert env["TREADLE_HOST_IP"] == "127.0.0.2" and env["TREADLE_CPU_THREADS"] == "3"


# -- pipeline stages on two hosts ----------------------------------------------------------


def test_stage_links_between_nodes_are_tcp_and_need_the_secret_off_loopback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The layout check alone (no cluster): a stage whose sender is on its node links by
    ipc, one on another node by tcp at its node's address; non-loopback tcp stage links
    without the secret are refused unless --insecure-cluster; a stage split across nodes is
    logged."""
    from treadle.executor.ray_executor import RayExecutor, RayRank
    from treadle.wire.topology import worker_title

    def layout(*where: tuple[str, str]) -> RayExecutor:
        ex = RayExecutor.__new__(RayExecutor)
        ex.tp_size, ex.pp_size, ex.world_size = 2, len(where) // 2, len(where)
        ex.ranks = [
            RayRank(worker_title(r, 2, ex.pp_size), "", node, ip)
            for r, (node, ip) in enumerate(where)
        ]
        ex._local = [r.node_id == "a" for r in ex.ranks]
        ex.stage_addresses = ex._stage_plan()
        return ex

    a, b, b2 = ("a", "10.0.0.1"), ("b", "10.0.0.2"), ("b2", "10.0.0.2")
    monkeypatch.delenv("TREADLE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("TREADLE_CLUSTER_SECRET_FILE", raising=False)
    # Stage 0 here, stages 1 and 2 on host b (the link between them stays on b, by ipc).
    ex = layout(a, a, b, b, b, b)
    assert ex.stage_addresses[:4] == [None, None, "tcp://10.0.0.2:0", "tcp://10.0.0.2:0"]
    assert all(str(addr).startswith("ipc://") for addr in ex.stage_addresses[4:])
    config: Any = types.SimpleNamespace(parallel=ParallelConfig(pipeline_parallel_size=3))
    with pytest.raises(ValueError, match=r"Worker_PP1_TP0's stage link on 10\.0\.0\.2") as e:
        ex._check_layout(config, "10.0.0.1")
    assert "the steps that Worker_PP1_TP0" in str(e.value) and "--insecure-cluster" in str(e.value)
    config.parallel = ParallelConfig(pipeline_parallel_size=3, insecure_cluster=True)
    ex._check_layout(config, "10.0.0.1")
    # Two Ray nodes on host b, the driver on loopback: only the tcp stage links face another
    # host.
    monkeypatch.setattr("treadle.ipc.cluster_auth.is_loopback", lambda h: h != "10.0.0.2")
    ex = layout(b, b, b2, b2)
    config.parallel = ParallelConfig(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="Worker_PP1_TP1's stage link on 10.0.0.2"):
        ex._check_layout(config, "127.0.0.1")
    monkeypatch.setenv("TREADLE_CLUSTER_SECRET", "ray-executor-test-secret-0123456789")
    ex._check_layout(config, "127.0.0.1")
    # A stage split over two nodes works, and says that its all-reduce crosses hosts.
    log = logging.getLogger("treadle.executor.ray_executor")  # (treadle's logs do not propagate)
    log.addHandler(caplog.handler)
    try:
        layout(a, b, b, b)._check_layout(config, "127.0.0.1")
    finally:
        log.removeHandler(caplog.handler)
    assert "Pipeline stage 0's TP ranks run on several nodes" in caplog.text


def test_tp2_pp2_over_two_hosts_gives_one_process_tokens(
    cluster, tiny_model_factory, reference
) -> None:  # type: ignore[no-untyped-def]
    """-tp 2 -pp 2 of 1-CPU bundles on two 2-CPU nodes: PACK puts two on each, ranks follow the
    nodes, so stage 0 runs here and stage 1 on 127.0.0.2; each stage-1 rank's stage link
    listens on 127.0.0.2 and stage 0's rank of its TP rank is connected to it. The greedy
    tokens are one process's."""
    llm = LLM(
        str(tiny_model_factory("llama")),
        dtype="float32",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        cpu_threads=1,
        distributed_executor_backend="ray",
    )
    try:
        ranks = {(p, t): _worker(cluster, f"Worker_PP{p}_TP{t}") for p in (0, 1) for t in (0, 1)}
        for (stage, _), proc in ranks.items():
            assert (proc.environ()["TREADLE_HOST_IP"] == "127.0.0.2") == (stage == 1)
        for tp in (0, 1):
            listening = {
                c.laddr.port
                for c in ranks[1, tp].net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.2"
            }
            assert any(
                c.raddr and c.raddr.ip == "127.0.0.2" and c.raddr.port in listening
                for c in ranks[0, tp].net_connections("tcp")
            )
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]


# -- a served engine across a node's death ---------------------------------------------------


def test_two_hosts_serve_the_same_text_across_a_lost_node_and_name_it_once_gone(
    cluster, tiny_model_factory, reference, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """-tp 2 over two "hosts": greedy text as one process gives; the second host removed while
    8 streams run -> engine death -> restart once the node is back -> the same text; removed
    for good -> the restart fails naming `ray status`, and the death names the rank and node.
    (Last in the module: it leaves no second host.)"""
    model = str(tiny_model_factory("llama"))
    prompts = PROMPTS
    texts_of_one = [o.outputs[0].text for o in reference]
    srv = RemoteServer(
        [model, "-tp", "2", "--cpu-threads", "2", "--dtype", "float32"]
        + ["--distributed-executor-backend", "ray", "--max-engine-restarts", "2"],
        tmp_path,
        wait=False,
    )
    try:
        srv.wait_healthy(120.0)
        # Rank 1 runs on the second "host" and reads the broadcast over tcp from there.
        rank1 = _worker(cluster, "Worker_TP1")
        assert rank1.environ()["TREADLE_HOST_IP"] == "127.0.0.2"
        assert any(
            c.laddr.ip == "127.0.0.2" and c.raddr and c.raddr.ip != "127.0.0.2"
            for c in rank1.net_connections("tcp")
        )
        assert _worker(cluster, "Worker_TP0").environ()["TREADLE_HOST_IP"] != "127.0.0.2"
        topology = httpx.get(srv.url + "/topology", timeout=30).json()
        workers = {p["title"]: p for p in topology["processes"] if p["role"] == "Worker"}
        assert workers["Worker_TP1"]["host"] == "127.0.0.2"
        assert workers["Worker_TP1"]["pid"] == rank1.pid
        assert workers["Worker_TP0"]["ray_node_id"] != workers["Worker_TP1"]["ray_node_id"] != ""
        for worker in workers.values():  # the remote one too: its engine reported it
            assert (worker["dp_rank"], worker["state"]) == (0, "ready"), worker
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            seen: list[list[float]] = [[] for _ in prompts]
            futures = [
                pool.submit(stream_text, srv.url, p, MAX_TOKENS, s)
                for p, s in zip(prompts, seen, strict=True)
            ]
            while min(len(s) for s in seen) < 5:
                assert not any(f.done() for f in futures), [f.result() for f in futures]
                time.sleep(0.01)
            cluster.remove_node(_second_host(cluster))
            time.sleep(0.5)
            cluster.add_node(**SECOND_HOST)
            texts = [f.result(120) for f in futures]
        assert texts == texts_of_one
        out = srv.output()
        assert re.search(r"Worker_TP1 \(pid \d+, Ray node \w+ at 127\.0\.0\.2\) died: ", out), out
        assert "resuming 8 request(s)" in out, out
        # Gone for good: the restart cannot place rank 1.
        cluster.remove_node(_second_host(cluster))
        with pytest.raises(Exception):  # noqa: B017 - the stream fails however it fails
            stream_text(srv.url, prompts[0], MAX_TOKENS)
        deadline = time.monotonic() + 60
        while "`ray status`" not in srv.output() and time.monotonic() < deadline:
            time.sleep(0.5)
        out = srv.output()
        assert "Ray could not place 2 workers" in out and "`ray status`" in out, out
    finally:
        srv.stop()
