"""A local process that connects to a live server's request ROUTER as engine core 0 (its old
routing identity, with no token or a wrong one) is refused and logged; requests keep going to
the real engine, and an engine restarted by the server is still taken back (issue 28, item 4)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from serve_helpers import RemoteServer


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_factory: Any
) -> Iterator[RemoteServer]:
    model = str(tiny_model_factory("llama"))
    srv = RemoteServer(
        [model, "--max-engine-restarts", "3", "--kv-cache-memory", "8MiB", "--max-model-len", "256"],
        tmp_path_factory.mktemp("takeover"),
    )  # fmt: skip
    yield srv
    srv.stop()


def complete(server: RemoteServer, timeout: float = 60) -> str:
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": model, "prompt": "Hello there", "max_tokens": 4, "temperature": 0},
        timeout=timeout,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_an_impostor_engine_is_refused_and_serving_goes_on(server: RemoteServer) -> None:
    reference = complete(server)
    ctx: zmq.Context[Any] = zmq.Context()
    impostors = []
    forged: list[dict[str, Any]] = [
        {"status": "READY", "num_blocks": 1, "max_model_len": 8, "vocab_size": 8},  # no token
        {"status": "READY", "rank": 0, "launch": 1, "token": b"\x00" * 32},  # a wrong one
        {"status": "READY", "rank": 0, "launch": 99, "token": os.urandom(32)},
    ]
    try:
        # Every socket file of the server (its ROUTER among them), as any local process could.
        for path in sorted(server.rpc_dir.iterdir()):
            for identity, message in zip(
                (b"\x00\x00", b"\x00\x00", os.urandom(5)), forged, strict=True
            ):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IDENTITY, identity)
                sock.connect(f"ipc://{path}")
                sock.send(msgspec.msgpack.encode(message))
                impostors.append(sock)
        time.sleep(1.0)  # (before the fix, the first impostor took engine 0's routing now)
        for _ in range(3):
            assert complete(server, timeout=30) == reference
        for sock in impostors:
            assert not sock.poll(0), "a request went to an impostor"
    finally:
        for sock in impostors:
            sock.close(linger=0)
        ctx.term()
    # The impostors leaving is logged (up to 2 s later each): let it settle, so that the next
    # test counts only its own engine's lines.
    settled, last, since = time.monotonic() + 20, -1, time.monotonic()
    while time.monotonic() < settled and time.monotonic() - since < 3:
        count = server.output().count("socket disconnected")
        if count != last:
            last, since = count, time.monotonic()
        time.sleep(0.2)
    assert "Refused a peer of the request socket that claims to be an engine core" in (
        server.output()
    )


def test_a_restarted_engine_is_taken_back(server: RemoteServer) -> None:
    reference = complete(server)
    before = len(server.output())
    pid = server.pid_of("treadle::EngineCore_DP0")
    os.kill(pid, signal.SIGKILL)
    time.sleep(1.0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/health/ready", timeout=5).status_code == 200:
            break
        time.sleep(0.2)
    assert complete(server) == reference
    # The engine's sockets closing is logged with what is known, not a hint about sizes.
    lines = [
        line
        for line in server.output()[before:].splitlines()
        if "A peer of the" in line and "socket disconnected" in line
    ]
    assert len(lines) == 2, lines  # the request and the output socket
    for line in lines:
        assert f"EngineCore_DP0 (pid {pid}) exited: killed by signal 9 (SIGKILL)" in line, line
        assert "TREADLE_ZMQ_MAX_MSG_BYTES" not in line, line
