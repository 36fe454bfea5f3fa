"""Under the supervisor (`--api-server-count 2`, issue 25): a local engine whose restart
fails is lost while the other serves, as with one API server (the supervisor tells every API
server, `EngineLost` over a PUB socket, and each resumes its requests on the others); the
supervisor's restart line quotes the engine's death report (an API server hands it on).

One server for the module, its tests in file order (each also holds alone): engine 0 raises
on token 49001 and is restarted twice; engine 1's restart fails (test hooks), so it is last."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from test_engine_restart import stream_completion

from serve_helpers import RemoteServer


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory) -> Iterator[RemoteServer]:  # type: ignore[no-untyped-def]
    server = RemoteServer(
        [str(tiny_model_factory("llama")), "-dp", "2", "--api-server-count", "2",
         "--max-engine-restarts", "5"],
        tmp_path_factory.mktemp("supervised"),
        env={
            "TREADLE_TEST_FAIL_RESTART_RANK": "1",
            "TREADLE_TEST_RAISE_ON_TOKEN": "49001",
            "TREADLE_LOGGING_LEVEL": "INFO",
        },
    )  # fmt: skip
    yield server
    server.stop()


def test_the_supervisors_restart_line_quotes_the_engines_death_report(
    srv: RemoteServer,
) -> None:
    """An engine made to raise under two API servers: the supervisor restarts it, and its
    line says what it raised (API server 0 hands the report on), as the API servers' do."""
    resp = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": [1, 2, 49001], "max_tokens": 4},
        headers={"X-data-parallel-rank": "0"},  # (engine 1's restart fails, by design)
        timeout=120,
    )  # it kills its engine, resumes, kills it again: it fails with the second death
    assert resp.status_code == 500, resp.text
    raised = "exit code 1; it raised RuntimeError: TREADLE_TEST_RAISE_ON_TOKEN"
    deadline = time.monotonic() + 30  # (the request may fail before the second line)
    while True:
        lines = [
            line
            for line in srv.output().splitlines()
            if "APIServerSupervisor" in line and "Restarting it" in line
        ]
        if len(lines) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(lines) == 2 and all(raised in line for line in lines), lines


def test_a_bad_scale_is_refused_with_two_api_servers(srv: RemoteServer) -> None:
    """`POST /scale` with two API servers (`test_engine_scale_supervised.py` scales them): a
    size out of range gets a 400 that says what to change, and both serve on."""
    answer = httpx.post(srv.url + "/scale", json={"data_parallel_size": 0}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert "at least 1" in answer.json()["error"]["message"]
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_a_supervised_engine_whose_restart_fails_is_lost_while_the_other_serves(
    srv: RemoteServer,
) -> None:
    reference = stream_completion(srv.url, "hello there", 300, rank=0)
    gaps: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream_completion, srv.url, "hello there", 300, 1, gaps)
        while len(gaps) < 3:
            assert not future.done(), future.result()
            time.sleep(0.01)
        os.kill(srv.pid_of("treadle::EngineCore_DP1"), signal.SIGKILL)
        assert future.result(120) == reference  # resumed on engine 0
    output = srv.output()
    assert "EngineCore_DP1 is lost, the others serve on" in output, output[-3000:]
    assert srv.proc.poll() is None  # the server serves on
    for _ in range(4):  # whichever API server answers
        assert stream_completion(srv.url, "hello there", 300) == reference
        ready = httpx.get(srv.url + "/health/ready", timeout=10)
        assert ready.status_code == 503 and "engine core 1 is lost" in ready.text
        engines = httpx.get(srv.url + "/topology", timeout=30).json()["engines"]
        assert [e["state"] for e in engines] == ["ready", "lost"]
        assert "restarting it failed" in engines[1]["last_death"]["cause"]
        pinned = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            headers={"X-data-parallel-rank": "1"},
            timeout=30,
        )
        assert pinned.status_code == 503 and "lost" in pinned.json()["error"]["message"]
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
