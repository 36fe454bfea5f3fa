"""A real `treadle serve` process for end-to-end tests: 127.0.0.1, an OS-chosen port, always
stopped by pid (with its children) when the test is done."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

TREADLE = str(Path(sys.executable).parent / "treadle")


class RemoteServer:
    def __init__(
        self, args: list[str], tmp_path: Path, env: dict[str, str] | None = None, wait: bool = True
    ):
        # A short directory of its own: ipc socket paths must fit in 107 bytes.
        self.rpc_dir = Path(tempfile.mkdtemp(prefix="treadle-rpc-"))
        self.log_path = tmp_path / "server.log"
        full_env = dict(os.environ, TREADLE_RPC_BASE_PATH=str(self.rpc_dir), **(env or {}))
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [TREADLE, "serve", *args, "--host", "127.0.0.1", "--port", "0"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
        self.url = ""
        if wait:
            try:
                self.wait_healthy()
            except BaseException:
                self.stop()  # nobody else holds this object yet to stop it
                raise

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            if not self.url:
                m = re.search(
                    r"(?:Uvicorn running|listening) on (http://[\d.]+:\d+)", self.output()
                )
                if m:
                    self.url = m.group(1)
            if self.url:
                try:
                    # (/health too is 200 only once every engine is ready: health.py)
                    if httpx.get(self.url + "/health/startup", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def family(self) -> list[psutil.Process]:
        """The server process and all its descendants that are still alive."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def pid_of(self, title: str) -> int:
        for p in self.family():
            try:
                if p.cmdline() and p.cmdline()[0].strip() == title:
                    return p.pid
            except psutil.NoSuchProcess:
                continue
        raise LookupError(title)

    def stop(self) -> None:
        procs = self.family()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(procs, timeout=10)
        self.log.close()
        shutil.rmtree(self.rpc_dir, ignore_errors=True)


def treadle_titles(server: RemoteServer) -> list[str]:
    titles = []
    for p in server.family():
        cmd = p.cmdline()
        if cmd and cmd[0].startswith("treadle::"):
            titles.append(cmd[0].strip())
    return sorted(titles)


def assert_no_leftovers(server: RemoteServer, pids: list[int]) -> None:
    """Every pid in `pids` is gone (or a zombie) within 10 s, and no ipc socket file is left."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids
    ):
        time.sleep(0.1)
    alive = [
        p
        for p in pids
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]
    assert not alive, f"processes left: {alive}"
    deadline = time.monotonic() + 2  # a child's files may go a moment after the child
    while list(server.rpc_dir.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(server.rpc_dir.iterdir()) == [], f"ipc socket files left:\n{server.output()}"


# title prefix -> (role, the rank the title ends with)
TITLE_RANKS = {
    "APIServer_": ("APIServer", "api_server"),
    "EngineCore_DP": ("EngineCore", "dp_rank"),
    "Worker_TP": ("Worker", "tp_rank"),
}


def check_topology(server: RemoteServer, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """`GET /topology` lists exactly the titled processes of the server's tree (by title and
    pid), each with the role and rank its title says and state "ready"; every channel joins
    two of them, and each ipc endpoint is a socket file that its binding end holds open.
    Returns the document."""
    resp = httpx.get(server.url + "/topology", headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    topo: dict[str, Any] = resp.json()
    titled = {}
    for p in server.family():
        with contextlib.suppress(psutil.NoSuchProcess):
            cmd = p.cmdline()
            if cmd and cmd[0].startswith("treadle::"):
                titled[(cmd[0].strip().removeprefix("treadle::"), p.pid)] = p
    procs = {p["id"]: p for p in topo["processes"]}
    assert {(p["title"], p["pid"]) for p in procs.values()} == set(titled)
    for p in procs.values():
        assert p["state"] == "ready", p
        prefix = next((t for t in TITLE_RANKS if p["title"].startswith(t)), None)
        if prefix is None:
            assert p["role"] == p["title"]
        else:
            role, rank = TITLE_RANKS[prefix]
            assert p["role"] == role
            assert p[rank] == int(p["title"].removeprefix(prefix))
        if p["role"] == "Worker":
            parent = procs[f"{p['host']}:{p['ppid']}"]
            assert (parent["role"], parent["dp_rank"]) == ("EngineCore", p["dp_rank"])
    bound: dict[int, set[str]] = {}  # pid -> the unix socket paths it holds
    for c in topo["channels"]:
        ends = [c["from"], *c["to"]]
        assert all(end in procs for end in ends), c
        binder = c["from"] if c.get("bound_by", "from") == "from" else c["to"][0]
        for key in ("address", "overflow_address", "notify_address"):
            address = c.get(key, "")
            if address.startswith("ipc://"):
                pid = procs[binder]["pid"]
                if pid not in bound:
                    unix = psutil.Process(pid).net_connections(kind="unix")
                    bound[pid] = {s.laddr for s in unix}
                assert address.removeprefix("ipc://") in bound[pid], (c, key)
        if c["transport"] == "shm":
            assert os.path.exists(f"/dev/shm/{c['address']}"), c
    return topo


def channel_counts(topo: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in topo["channels"]:
        counts[c["kind"]] = counts.get(c["kind"], 0) + 1
    return counts


def stream_text(url: str, prompt: str, max_tokens: int, chunks: list[float] | None = None) -> str:
    """The text of a greedy streamed completion of `max_tokens` tokens (ignore_eos) from the
    server at `url`; `chunks` gets each chunk's arrival time. A 200 and no error chunk are
    asserted."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
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
                if chunks is not None:
                    chunks.append(time.monotonic())
    return text


def both_views(
    srv: RemoteServer,
    done: Callable[[dict[str, Any]], bool],
    timeout: float = 90.0,
    headers: dict[str, str] | None = None,
) -> dict[int, dict[str, Any]]:
    """`/topology` from each of two API servers (each request a new connection: the kernel
    picks who accepts it), once `done` holds for the answers of both."""
    views: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    doc: dict[str, Any] = {}
    while len(views) < 2:
        assert time.monotonic() < deadline, (
            views,
            doc.get("events"),
            doc.get("engines"),
            srv.output()[-3000:],
        )
        doc = httpx.get(srv.url + "/topology", headers=headers, timeout=30).json()
        if done(doc):
            views[doc["served_by"]["api_server"]] = doc
        time.sleep(0.05)
    return views


def engines_of(view: dict[str, Any]) -> list[dict[str, Any]]:
    """What two API servers must say alike of each engine (not its load, which moves)."""
    keys = ("dp_rank", "state", "last_death")
    return [{k: e.get(k) for k in keys} for e in view["engines"]]
