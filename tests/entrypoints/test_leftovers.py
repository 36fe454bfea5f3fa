"""Every stop and crash path leaves /dev/shm and the ipc directory as it found them (issue
28, items 5 and 12): an engine core killed -9 (and restarted), an engine core sent SIGTERM alone
under --max-engine-restarts 0 (after forged control frames that changed nothing), an API server
killed -9.

Other sessions run servers on this machine at the same time, so /dev/shm is not compared as a
whole: the test collects the inodes of every /dev/shm file that the server's processes map
(named semaphores and shared-memory segments; a semaphore is mapped under a temporary name,
with the inode of its final one) and checks that no file with one of them is left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil
import pytest
import zmq

from serve_helpers import RemoteServer
from treadle.wire.control import ENGINE_CORE_DEAD, ENGINE_CORE_STOPPED, DeathReport

ARGS = ["--kv-cache-memory", "8MiB", "--max-model-len", "256"]


def shm_inodes(server: RemoteServer) -> set[int]:
    """Inodes of the /dev/shm files that the server's processes map now."""
    inodes: set[int] = set()
    for proc in server.family():
        try:
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                inodes.add(int(parts[4]))
    return inodes


def left_in_dev_shm(inodes: set[int]) -> list[str]:
    left = []
    for name in os.listdir("/dev/shm"):
        try:
            if os.stat(f"/dev/shm/{name}").st_ino in inodes:
                left.append(name)
        except FileNotFoundError:
            continue
    return left


def wait_gone(procs: list[psutil.Process], timeout: float = 30) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"still running: {alive}"


def complete(server: RemoteServer) -> None:
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


def wait_ready(server: RemoteServer, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(server.url + "/health/ready", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, server.output()[-3000:]
        time.sleep(0.2)


@pytest.fixture
def model(tiny_model_factory: Any) -> str:
    return str(tiny_model_factory("llama"))


def test_a_killed_engine_leaves_no_semaphore(model: str, tmp_path: Path) -> None:
    server = RemoteServer([model, *ARGS, "--max-engine-restarts", "3"], tmp_path)
    try:
        complete(server)
        inodes = shm_inodes(server)
        os.kill(server.pid_of("treadle::EngineCore_DP0"), signal.SIGKILL)
        time.sleep(1.0)
        wait_ready(server)
        complete(server)
        inodes |= shm_inodes(server)
        family = server.family()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        wait_gone(family)
        log = server.output()
        assert "leaked semaphore" not in log, log[-3000:]
        assert left_in_dev_shm(inodes) == []
        assert list(server.rpc_dir.iterdir()) == []
    finally:
        server.stop()


def push_forged_control_frames(rpc_dir: Path) -> int:
    """Push a forged ENGINE_CORE_STOPPED, ENGINE_CORE_DEAD and death report into every socket
    file of a server that takes a PUSH (its output PULL), as any local process of its user
    can; returns how many sockets took them."""
    report = msgspec.msgpack.encode(DeathReport(0, "RuntimeError: forged"))
    ctx: zmq.Context[Any] = zmq.Context()
    took = 0
    try:
        for path in rpc_dir.iterdir():
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(f"ipc://{path}")
            if sock.poll(2000, zmq.POLLOUT):  # (only a PULL takes a PUSH as its peer)
                took += 1
                sock.send(ENGINE_CORE_STOPPED)
                sock.send(ENGINE_CORE_DEAD)
                sock.send_multipart([ENGINE_CORE_DEAD, report])
                sock.send_multipart([ENGINE_CORE_DEAD, report, b"\x00" * 40])
            sock.close()
    finally:
        ctx.term()
    return took


def test_forged_control_frames_change_nothing_and_an_unasked_engine_stop_ends_it(
    model: str, tmp_path: Path
) -> None:
    """Under --max-engine-restarts 0 a forged ENGINE_CORE_DEAD ended the server with exit 1
    (and ENGINE_CORE_STOPPED with exit 0); now each is refused and logged, and the server
    serves on. A SIGTERM to the engine core alone is a death (never a clean exit 0): with
    no restarts, exit 1, leaving nothing behind."""
    server = RemoteServer([model, *ARGS, "--max-engine-restarts", "0"], tmp_path)
    try:
        complete(server)
        inodes = shm_inodes(server)
        family = server.family()
        assert push_forged_control_frames(server.rpc_dir) >= 1
        deadline = time.monotonic() + 10
        while server.output().count("on the output socket") < 4:
            assert time.monotonic() < deadline and server.proc.poll() is None, server.output()
            time.sleep(0.05)
        complete(server)
        assert httpx.get(server.url + "/health").status_code == 200
        os.kill(server.pid_of("treadle::EngineCore_DP0"), signal.SIGTERM)
        assert server.proc.wait(60) == 1, server.output()[-3000:]
        assert "SIGTERM was sent to this engine core alone" in server.output()
        wait_gone(family)
        assert left_in_dev_shm(inodes) == []
        assert list(server.rpc_dir.iterdir()) == []
        assert "leaked semaphore" not in server.output()
    finally:
        server.stop()


def test_a_killed_api_server_leaves_nothing(model: str, tmp_path: Path) -> None:
    server = RemoteServer([model, *ARGS], tmp_path)
    try:
        complete(server)
        inodes = shm_inodes(server)
        family = server.family()
        server.proc.kill()  # its engine core notices and goes
        wait_gone(family)
        assert left_in_dev_shm(inodes) == []
        assert list(server.rpc_dir.iterdir()) == []
    finally:
        server.stop()
