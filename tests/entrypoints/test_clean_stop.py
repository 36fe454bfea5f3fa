"""SIGINT/SIGTERM to the process group, to the API server alone or to one TP worker alone, in
the middle of a step with streams running: every stream ends, the log has no ERROR and no
traceback, and `treadle serve` exits 0. (A signal to the engine core alone is a death, not a
stop: `test_engine_restart.py`, `test_leftovers.py`.)"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from serve_helpers import TREADLE


class Server:
    """`treadle serve` in a session (process group) of its own, so that a test can signal the
    whole group as a terminal's Ctrl-C does. Always killed (its group only) at the end."""

    def __init__(self, model: str, log_path: Path, extra: list[str] = ()) -> None:  # type: ignore[assignment]
        self.rpc_dir = tempfile.mkdtemp(prefix="treadle-rpc-")
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in kill()
        env = dict(os.environ, TREADLE_RPC_BASE_PATH=self.rpc_dir, TREADLE_LOGGING_LEVEL="INFO")
        self.proc = subprocess.Popen(
            [TREADLE, "serve", model, "--host", "127.0.0.1", "--port", "0", *extra],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.url = ""
        self.model = ""

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", self.output())
            if m:
                self.url = m.group(1)
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(self.url + "/health/startup", timeout=5).status_code == 200:
                        models = httpx.get(self.url + "/v1/models", timeout=5).json()
                        self.model = models["data"][0]["id"]
                        return
            time.sleep(0.1)
        raise TimeoutError(self.output())

    def pid_of(self, title: str) -> int:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.cmdline()[0].strip() == title:
                    return child.pid
        raise LookupError(title)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # this server's own group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.log.close()
        for name in os.listdir(self.rpc_dir):
            os.unlink(os.path.join(self.rpc_dir, name))
        os.rmdir(self.rpc_dir)


@pytest.fixture
def start_server(tmp_path: Path, tiny_model_factory) -> Iterator:  # type: ignore[no-untyped-def,type-arg]
    servers: list[Server] = []
    model = str(tiny_model_factory("llama"))

    def start(extra: list[str] = ()) -> Server:  # type: ignore[assignment]
        server = Server(model, tmp_path / f"server{len(servers)}.log", list(extra))
        servers.append(server)
        server.wait_healthy()
        return server

    yield start
    for server in servers:
        server.kill()


def _stream(server: Server, results: list[str], started: threading.Event) -> None:
    body = {
        "model": server.model,
        "prompt": "hello " * 50,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        lines = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if line.startswith("data: {"):
                    started.set()
        results.append("done" if lines and lines[-1] == "data: [DONE]" else f"cut: {lines[-1:]}")
    except httpx.HTTPError as e:
        results.append(f"error: {type(e).__name__}")


def stop_during_a_step(server: Server, target: str, sig: signal.Signals) -> None:
    """Start 4 long streams, signal `target` (group, api, worker) while they run, and check
    that the streams end, the server exits 0 and nothing in the log is an error."""
    results: list[str] = []
    # Every stream has its first token before the signal, so it lands during steps with all
    # four in flight (a client still connecting when the listener closes is refused, rightly).
    started = [threading.Event() for _ in range(4)]
    threads = [threading.Thread(target=_stream, args=(server, results, e)) for e in started]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in started)
    time.sleep(0.2)
    if target == "group":
        os.killpg(server.proc.pid, sig)
    elif target == "api":
        os.kill(server.proc.pid, sig)
    else:
        os.kill(server.pid_of("treadle::Worker_TP1"), sig)
    code = server.proc.wait(60)
    for t in threads:
        t.join(30)
    log = server.output()
    assert code == 0, log
    assert "ERROR" not in log and "Traceback" not in log, log
    assert len(results) == 4 and all(r == "done" for r in results), (results, log)


@pytest.mark.parametrize(
    ("target", "sig"),
    [
        ("group", signal.SIGINT),
        ("group", signal.SIGTERM),
        ("api", signal.SIGINT),
        ("api", signal.SIGTERM),
    ],
    ids=[
        "ctrl-c-to-the-group",
        "sigterm-to-the-group",
        "sigint-to-the-api-server",
        "sigterm-to-the-api-server",
    ],
)
def test_a_stop_during_a_step_is_clean(start_server, target: str, sig: signal.Signals) -> None:  # type: ignore[no-untyped-def]
    """Every target with both signals (each case once: the ten-in-a-row version that repeated
    four of them cost ~3 minutes of `make test`)."""
    stop_during_a_step(start_server(), target, sig)


def test_sigterm_to_one_tp_worker_stops_the_whole_server_cleanly(start_server) -> None:  # type: ignore[no-untyped-def]
    """The worker asks its engine core to stop (SIGUSR1) instead of leaving its rank's
    collective half done, which would fail the other rank with an ERROR."""
    stop_during_a_step(start_server(["-tp", "2"]), "worker", signal.SIGTERM)


def test_requests_that_arrive_during_a_stop_end_too(start_server) -> None:  # type: ignore[no-untyped-def]
    """Requests sent just after the signal reach the engine core during its last moments (or
    never): each ends (a stream, an error event or a refused connection), none holds the
    shutdown until uvicorn cancels it with an ERROR."""
    for _ in range(2):
        server = start_server()
        first: list[str] = []
        results: list[str] = []
        started = threading.Event()
        running = [threading.Thread(target=_stream, args=(server, first, started))]
        running[0].start()
        assert started.wait(30)
        os.kill(server.proc.pid, signal.SIGINT)
        late = [
            threading.Thread(target=_stream, args=(server, results, threading.Event()))
            for _ in range(4)
        ]
        for t in late:
            t.start()
        code = server.proc.wait(60)
        for t in running + late:
            t.join(30)
            assert not t.is_alive()
        log = server.output()
        assert code == 0, log
        assert "ERROR" not in log and "Traceback" not in log, log
        assert first == ["done"], (first, results)
        # A late request may be refused (ConnectError) or, when the kernel had accepted its
        # connection just before uvicorn closed the listener, dropped unanswered (ReadError,
        # RemoteProtocolError): it ends either way, which is what this test is about.
        ended = {"done", "error: ConnectError", "error: ReadError", "error: RemoteProtocolError"}
        assert len(results) == 4 and set(results) <= ended, results
