"""`--distributed-executor-backend ray` on two "hosts": one Ray cluster for the module, a head
node (this machine's address) and a node at 127.0.0.2, one CPU each, so that a `-tp 2` placement
group of one-CPU bundles puts rank 0 on the head and rank 1 on 127.0.0.2, which reads the
broadcast over tcp (CURVE: the module sets a cluster secret)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from serve_helpers import TREADLE, RemoteServer
from treadle import LLM, SamplingParams
from treadle.config import ParallelConfig
from treadle.engine_args import EngineArgs

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")

MAX_TOKENS = 48
# A dead node is seen in about a second, not Ray's default 15 s.
FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
SECOND_HOST = {"num_cpus": 1, "node_ip_address": "127.0.0.2"}


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
                "num_cpus": 1,
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


# -- a served engine across a node's death ---------------------------------------------------


def _stream(url: str, prompt: str, seen: list[int]) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    text = ""
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                seen.append(1)
    return text


def test_two_hosts_serve_the_same_text_across_a_lost_node_and_name_it_once_gone(
    cluster, tiny_model_factory, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """-tp 2 over two "hosts": greedy text as one process gives; the second host removed while
    8 streams run -> engine death -> restart once the node is back -> the same text; removed
    for good -> the restart fails naming `ray status`, and the death names the rank and node."""
    model = str(tiny_model_factory("llama"))
    prompts = [f"stream {i} says" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    single = LLM(model, dtype="float32")
    try:
        reference = [o.outputs[0].text for o in single.generate(prompts, params, use_tqdm=False)]
    finally:
        single.shutdown()
    srv = RemoteServer(
        [model, "-tp", "2", "--cpu-threads", "1", "--dtype", "float32"]
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
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            seen: list[list[int]] = [[] for _ in prompts]
            futures = [
                pool.submit(_stream, srv.url, p, s) for p, s in zip(prompts, seen, strict=True)
            ]
            while min(len(s) for s in seen) < 5:
                assert not any(f.done() for f in futures), [f.result() for f in futures]
                time.sleep(0.01)
            cluster.remove_node(_second_host(cluster))
            time.sleep(0.5)
            cluster.add_node(**SECOND_HOST)
            texts = [f.result(120) for f in futures]
        assert texts == reference
        out = srv.output()
        assert re.search(r"Worker_TP1 \(pid \d+, Ray node \w+ at 127\.0\.0\.2\) died: ", out), out
        assert "resuming 8 request(s)" in out, out
        # Gone for good: the restart cannot place rank 1.
        cluster.remove_node(_second_host(cluster))
        with pytest.raises(Exception):  # noqa: B017 - the stream fails however it fails
            _stream(srv.url, prompts[0], [])
        deadline = time.monotonic() + 60
        while "`ray status`" not in srv.output() and time.monotonic() < deadline:
            time.sleep(0.5)
        out = srv.output()
        assert "Ray could not place 2 workers" in out and "`ray status`" in out, out
    finally:
        srv.stop()
