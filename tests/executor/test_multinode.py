"""`--nnodes 2` without Ray on one machine with two "hosts": node 0 serves on 127.0.0.1, node 1
runs `--node-rank 1 --headless` with TREADLE_HOST_IP=127.0.0.2, so its ranks read the broadcast
over tcp and reply over tcp from 127.0.0.2 (loopback: no cluster secret needed)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from serve_helpers import TREADLE, RemoteServer, stream_text
from treadle import LLM, SamplingParams
from treadle.config import ParallelConfig
from treadle.executor import remote_node, rendezvous
from treadle.ipc.shm_broadcast import Handle

MAX_TOKENS = 24
PROMPTS = [f"stream {i} says" for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
FAST = {"TREADLE_NODE_HEARTBEAT_TIMEOUT_S": "3", "TREADLE_ENGINE_READY_TIMEOUT_S": "30"}
# The served pair keys its store values (HMAC) and tcp sockets (CURVE); the -pp pair does not.
KEYED = {**FAST, "TREADLE_CLUSTER_SECRET": "nodes-test-secret-0123456789"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node_flags(port: int, rank: int, *layout: str) -> list[str]:
    return [*layout, "--nnodes", "2", "--node-rank", str(rank), "--master-port", str(port)]


def _start_node1(
    model: str, port: int, tmp_path: Path, *layout: str, env: dict[str, str] = FAST
) -> RemoteServer:
    node1_dir = tmp_path / "node1"
    node1_dir.mkdir(exist_ok=True)
    flags = [model, *_node_flags(port, 1, *layout), "--headless", "--dtype", "float32"]
    return RemoteServer(flags, node1_dir, env={**env, "TREADLE_HOST_IP": "127.0.0.2"}, wait=False)


@pytest.fixture(scope="module")
def reference(tiny_model_factory) -> list[Any]:  # type: ignore[no-untyped-def]
    single = LLM(str(tiny_model_factory("llama")), dtype="float32")
    try:
        return single.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        single.shutdown()


@pytest.fixture(scope="module")
def nodes(tiny_model_factory, tmp_path_factory) -> Iterator[tuple[RemoteServer, RemoteServer]]:  # type: ignore[no-untyped-def]
    """Node 0 (the server) and node 1 (headless) of `-tp 2 --nnodes 2`."""
    model = str(tiny_model_factory("llama"))
    tmp = tmp_path_factory.mktemp("nodes")
    port = _free_port()
    node1 = _start_node1(model, port, tmp, "-tp", "2", env=KEYED)
    node0 = None
    try:
        flags = [model, *_node_flags(port, 0, "-tp", "2"), "--dtype", "float32"]
        node0 = RemoteServer(flags + ["--max-engine-restarts", "3"], tmp, env=KEYED, wait=False)
        node0.wait_healthy(120.0)
        yield node0, node1
    finally:
        if node0 is not None:
            node0.stop()
        node1.stop()


def _proc(server: RemoteServer, title: str) -> psutil.Process:
    return psutil.Process(server.pid_of(f"treadle::{title}"))


# -- checks before anything starts -----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nnodes": 2, "node_rank": 2, "master_port": 1}, r"--node-rank 2 must be between 0"),
        ({"tensor_parallel_size": 3, "nnodes": 2, "master_port": 1}, "does not divide the 3"),
        ({"tensor_parallel_size": 2, "nnodes": 2}, "needs --master-port"),
        (
            {"tensor_parallel_size": 2, "nnodes": 2, "master_port": 1, "data_parallel_size": 2},
            "for -dp over hosts",
        ),
        (
            {"tensor_parallel_size": 2, "nnodes": 2, "master_port": 1, "master_addr": "10.1.2.3"},
            "nothing keys the sockets between them",
        ),
    ],
)
def test_a_layout_the_nodes_cannot_follow_is_refused(
    kwargs: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TREADLE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("TREADLE_CLUSTER_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs).check()
    addr = {"master_addr": "10.1.2.3", "nnodes": 2, "tensor_parallel_size": 2, "master_port": 1}
    ParallelConfig(**addr, insecure_cluster=True).check()
    monkeypatch.setenv("TREADLE_CLUSTER_SECRET", "nodes-test-secret-0123456789")
    ParallelConfig(**addr).check()
    assert list(ParallelConfig(**addr, pipeline_parallel_size=2).node_ranks(1)) == [2, 3]


def test_node_rank_and_headless_go_together() -> None:
    proc = subprocess.run(
        [TREADLE, "serve", "-tp", "2", *_node_flags(1234, 1)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "treadle serve: error: --node-rank 1 runs only its ranks' workers: add --headless"
    )


def test_store_values_are_msgpack_sealed_with_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TREADLE_CLUSTER_SECRET_FILE", raising=False)
    monkeypatch.setenv("TREADLE_CLUSTER_SECRET", "nodes-test-secret-0123456789")
    sealed = rendezvous.seal("hello")
    assert sealed.startswith(b"T1") and rendezvous.unseal(sealed, str, "x") == "hello"
    with pytest.raises(ValueError, match="not sealed with this cluster's secret"):
        rendezvous.unseal(sealed[:-1] + b"!", str, "x")
    monkeypatch.setenv("TREADLE_CLUSTER_SECRET", "another-secret-0123456789abc")
    with pytest.raises(ValueError, match="not sealed with this cluster's secret"):
        rendezvous.unseal(sealed, str, "x")
    monkeypatch.delenv("TREADLE_CLUSTER_SECRET")
    with pytest.raises(ValueError, match="the other side has a cluster secret"):
        rendezvous.unseal(sealed, str, "x")
    assert rendezvous.unseal(rendezvous.seal([1, "a"]), list, "x") == [1, "a"]
    with pytest.raises(ValueError, match="not a treadle value"):
        rendezvous.unseal(b"\x80\x04pickle", str, "x")


def test_a_node_with_another_layout_says_what_differs() -> None:
    from treadle.config import EngineConfig

    plan = rendezvous.Plan(
        session="s", nnodes=2, tp=2, pp=2, broadcast=Handle(local_reader_ranks=[0, 1])
    )
    config: Any = EngineConfig.__new__(EngineConfig)
    object.__setattr__(config, "parallel", ParallelConfig(tensor_parallel_size=4, nnodes=2))
    assert remote_node._mismatch(plan, config, "10.0.0.1", 5) == (
        "node 0 runs -tp 4 -pp 1 --nnodes 2, but the engine core at 10.0.0.1:5 runs -tp 2 -pp 2 "
        "--nnodes 2: give every node the same -tp, -pp and --nnodes"
    )


# -- two "hosts" -------------------------------------------------------------------------------


def test_tp2_pp2_over_two_nodes_gives_one_process_tokens(
    tiny_model_factory, reference, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Stage 0 here (the offline LLM's engine core), stage 1 on node 1: its ranks' stage links
    listen on 127.0.0.2."""
    model = str(tiny_model_factory("llama"))
    port = _free_port()
    node1 = _start_node1(model, port, tmp_path, "-tp", "2", "-pp", "2", "--cpu-threads", "1")
    try:
        llm = LLM(
            model,
            dtype="float32",
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            cpu_threads=1,
            nnodes=2,
            master_port=port,
        )
        try:
            stage1 = [_proc(node1, f"Worker_PP1_TP{t}") for t in (0, 1)]
            for p in stage1:
                assert any(
                    c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.2"
                    for c in p.net_connections("tcp")
                )
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        finally:
            llm.shutdown()
    finally:
        node1.stop()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]


def test_tp2_over_two_nodes_serves_one_process_text(nodes, reference) -> None:  # type: ignore[no-untyped-def]
    node0, node1 = nodes
    rank0, rank1 = _proc(node0, "Worker_TP0"), _proc(node1, "Worker_TP1")
    assert rank0.parent().cmdline()[0].strip() == "treadle::EngineCore_DP0"
    assert rank1.parent().cmdline()[0].strip() == "treadle::Node_1"
    # (setproctitle overwrites /proc/PID/environ: its sockets say where it runs)
    assert any(
        c.laddr.ip == "127.0.0.2" and c.status == psutil.CONN_LISTEN
        for c in rank1.net_connections("tcp")
    )
    topology = httpx.get(node0.url + "/topology", timeout=30).json()
    workers = {p["title"]: p for p in topology["processes"] if p["role"] == "Worker"}
    assert (workers["Worker_TP1"]["host"], workers["Worker_TP1"]["pid"]) == ("127.0.0.2", rank1.pid)
    assert workers["Worker_TP0"]["pid"] == rank0.pid
    assert "127.0.0.2" in topology["hosts"]
    for worker in workers.values():  # the remote one too: its engine reported it
        assert (worker["dp_rank"], worker["state"]) == (0, "ready"), worker
    texts = [stream_text(node0.url, p, MAX_TOKENS) for p in PROMPTS]
    assert texts == [o.outputs[0].text for o in reference]


def test_a_killed_remote_worker_restarts_the_engine_and_the_streams_finish(
    nodes, reference
) -> None:  # type: ignore[no-untyped-def]
    node0, node1 = nodes
    victim = _proc(node1, "Worker_TP1")
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        seen: list[list[float]] = [[] for _ in PROMPTS]
        futures = [
            pool.submit(stream_text, node0.url, p, MAX_TOKENS, s)
            for p, s in zip(PROMPTS, seen, strict=True)
        ]
        while min(len(s) for s in seen) < 3:
            assert not any(f.done() for f in futures), [f.result() for f in futures]
            time.sleep(0.01)
        victim.kill()
        texts = [f.result(120) for f in futures]
    assert texts == [o.outputs[0].text for o in reference]
    out = node0.output()
    assert re.search(r"resuming \d+ request\(s\)", out), out
    assert _proc(node1, "Worker_TP1").pid != victim.pid


def test_a_node_gone_for_good_is_named(nodes) -> None:  # type: ignore[no-untyped-def]
    """Last: node 1 stops; the engine core sees its heartbeat stop, and its restart names the
    node and rank that never come."""
    node0, node1 = nodes
    node1.stop()
    with contextlib.suppress(Exception):
        stream_text(node0.url, PROMPTS[0], MAX_TOKENS)
    deadline = time.monotonic() + 60
    while "did not join" not in node0.output() and time.monotonic() < deadline:
        time.sleep(0.5)
    out = node0.output()
    assert "no heartbeat" in out or "Worker_TP1" in out, out
    assert re.search(r"node\(s\) 1 did not join in \d+ s", out), out
    assert "rank(s) [1] (Worker_TP1) are missing" in out, out
