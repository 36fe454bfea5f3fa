"""The start-up is visible (issue 25 item 3): an API server serves HTTP as soon as its port
is bound, while its engine loads. `/health` (llama-server's "Loading model"),
`/health/startup` and `/health/ready` are 503 with the engine's phase, `/topology` shows the phase, and a generation
request gets 503 at once instead of hanging; once loaded, `/health/startup` is 200.

With one API server, and with two (`--api-server-count 2`: the supervisor runs the
handshake and tells each API server the phases it sees). One server start per count,
slowed by the test hook TREADLE_TEST_SLOW_START_S (the engine sleeps in its "loading
weights" phase), watched from the moment the port is known."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from serve_helpers import RemoteServer, assert_no_leftovers

SLOW_S = 6.0


@dataclass
class Watch:
    """What a client saw from the moment the port was announced until start-up ended."""

    server: RemoteServer
    startup: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (status, body)
    while_loading: dict[str, Any] = field(default_factory=dict)  # one look at each route


def look_while_loading(url: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=10) as c:
        health = c.get("/health")
        seen["health"] = (health.status_code, health.json())
        ready = c.get("/health/ready")
        seen["ready"] = (ready.status_code, ready.json())
        seen["topology"] = c.get("/topology").json()
        started = time.monotonic()
        completion = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        seen["completion"] = (completion.status_code, completion.json())
        seen["completion_s"] = time.monotonic() - started
        seen["models"] = c.get("/v1/models").status_code
    return seen


def wait_for_url(srv: RemoteServer, deadline: float) -> None:
    while not srv.url and time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.output()
        m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", srv.output())
        srv.url = m.group(1) if m else ""
        time.sleep(0.05)


API_SERVERS = [1, 2]


def serve_args(model: str, api_servers: int) -> list[str]:
    return [model, "--max-model-len", "128", "--api-server-count", str(api_servers)]


@pytest.fixture(scope="module", params=API_SERVERS, ids=lambda n: f"{n}-api-servers")
def watch(request, tmp_path_factory: pytest.TempPathFactory, tiny_model_factory) -> Iterator[Watch]:  # type: ignore[no-untyped-def]
    srv = RemoteServer(
        serve_args(str(tiny_model_factory("llama")), request.param),
        tmp_path_factory.mktemp("startup"),
        env={"TREADLE_TEST_SLOW_START_S": str(SLOW_S)},
        wait=False,
    )
    try:
        seen = Watch(srv)
        deadline = time.monotonic() + 180
        wait_for_url(srv, deadline)
        while time.monotonic() < deadline:
            assert srv.proc.poll() is None, srv.output()
            resp = httpx.get(srv.url + "/health/startup", timeout=10)
            seen.startup.append((resp.status_code, resp.json()))
            if resp.status_code == 200:
                break
            phases = [e["phase"] for e in resp.json()["engines"]]
            if phases == ["loading weights"] and not seen.while_loading:
                seen.while_loading = look_while_loading(srv.url)
            time.sleep(0.1)
        yield seen
    finally:
        srv.stop()


def test_startup_probe_is_503_with_the_phase_then_200(watch: Watch) -> None:
    statuses = [status for status, _ in watch.startup]
    assert statuses[0] == 503 and statuses[-1] == 200, watch.server.output()
    assert set(statuses[:-1]) == {503}
    first = watch.startup[0][1]
    assert first["status"] == "starting" and first["error"]["code"] == 503
    phases = [e["engines"][0]["phase"] for _, e in watch.startup]
    assert "loading weights" in phases
    # In the order of the start-up, never back.
    order = [
        "starting",
        "loading weights",
        "profiling the KV cache",
        "allocating the KV cache",
        "handshake",
        "ready",
    ]
    assert [order.index(p) for p in phases] == sorted(order.index(p) for p in phases)
    assert watch.startup[-1][1] == {
        "status": "ready",
        "engines": [{"dp_rank": 0, "phase": "ready"}],
    }


def test_while_loading_every_probe_says_starting(watch: Watch) -> None:
    seen = watch.while_loading
    assert seen, "never saw the loading phase"
    status, body = seen["health"]  # llama-server's answer while it loads
    assert status == 503
    assert body["error"]["message"] == "Loading model"
    assert body["error"]["type"] == "ServiceUnavailableError"
    assert body["status"] == "starting"
    assert body["phase"] in ("loading weights", "profiling the KV cache")
    status, body = seen["ready"]
    assert status == 503 and "the engine is starting" in body["error"]["message"]
    assert body["error"]["type"] == "ServiceUnavailableError"  # as every "not yet" 503
    engines = seen["topology"]["engines"]
    assert [(e["dp_rank"], e["state"]) for e in engines] == [(0, "starting")]
    assert engines[0]["phase"] in ("loading weights", "profiling the KV cache")
    assert any(p["role"] == "EngineCore" for p in seen["topology"]["processes"])


def test_a_request_during_the_start_up_gets_503_at_once(watch: Watch) -> None:
    seen = watch.while_loading
    status, body = seen["completion"]
    assert status == 503
    assert body["error"]["type"] == "ServiceUnavailableError"
    assert body["error"]["message"].startswith("the engine is starting: ")
    assert seen["completion_s"] < 5
    assert seen["models"] == 503


def test_once_started_it_serves_and_topology_says_ready(watch: Watch) -> None:
    url = watch.server.url
    # Every API server, whichever takes the connection (two finish within moments).
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health/startup", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, watch.server.output()
        time.sleep(0.1)
    for _ in range(4):
        assert httpx.get(url + "/health/ready", timeout=10).status_code == 200
    engines = httpx.get(url + "/topology", timeout=30).json()["engines"]
    assert [(e["state"], e["phase"]) for e in engines] == [("ready", "ready")]
    resp = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("api_servers", API_SERVERS)
def test_sigterm_while_loading_stops_everything_and_exits_0(  # type: ignore[no-untyped-def]
    api_servers: int, tmp_path, tiny_model_factory
) -> None:
    """(Another server start: this one never finishes loading.)"""
    srv = RemoteServer(
        serve_args(str(tiny_model_factory("llama")), api_servers),
        tmp_path,
        env={"TREADLE_TEST_SLOW_START_S": "60"},
        wait=False,
    )
    try:
        deadline = time.monotonic() + 120
        wait_for_url(srv, deadline)
        while time.monotonic() < deadline:
            body = httpx.get(srv.url + "/health/startup", timeout=10).json()
            if body["engines"][0]["phase"] == "loading weights":
                break
            time.sleep(0.1)
        pids = [p.pid for p in srv.family()]
        assert srv.pid_of("treadle::EngineCore_DP0") in pids
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.output()
        assert time.monotonic() - started < 10, "the stop waited for the start-up"
        assert_no_leftovers(srv, pids)
    finally:
        srv.stop()
