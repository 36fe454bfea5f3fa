"""`POST /scale` with engines on other hosts (issue 42 item 3): a head with `-dp 2 -dpl 1`
(two API servers by default: the supervisor runs the scale) and a `--headless` engine at
rank 1, on loopback. 2 -> 3 while 16 greedy streams run: the engine for rank 2 is started
first with `treadle serve --headless -dp 3 -dpl 1 -dpr 2` (its HELLO waits on the head until
the scale admits rank 2); 3 -> 2: rank 2 is drained in both API servers, released, and its
headless CLI exits 0. Every stream's text is the undisturbed run's; each scale is one
`scaled` event in both API servers, and no engine is counted dead or lost."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from test_data_parallel import _free_port
from test_engine_scale import AUTH, KEY, Streams, complete_on, prompts, scale, scale_under_streams

from serve_helpers import TREADLE, RemoteServer, both_views, engines_of


class Cluster:
    """The head (`RemoteServer`) and its headless CLIs, each killed by pid at the end."""

    def __init__(
        self, model: str, tmp: Path, api_servers: int = 2, size: int = 2, remote: int = 1
    ) -> None:
        """A head with engine 0 of `size`, and one headless CLI with the `remote` others."""
        self.model, self.tmp = model, tmp
        self.port = str(_free_port())
        flags = ["--api-key", KEY, "--max-engine-restarts", "5"]
        self.head = RemoteServer(
            [model, *self.common(size), *flags, "--api-server-count", str(api_servers)],
            tmp,
            # (a scale out that cannot join fails within a minute, not five)
            env={"TREADLE_LOGGING_LEVEL": "INFO", "TREADLE_SCALE_JOIN_TIMEOUT_S": "60"},
            wait=False,
        )
        self.headless: list[subprocess.Popen[bytes]] = []
        self.start_headless(size, 1, remote)

    def common(self, size: int, local: int = 1) -> list[str]:
        return ["-dp", str(size), "-dpl", str(local), "-dpa", "127.0.0.1", "-dpp", self.port]

    def start_headless(self, size: int, rank: int, local: int = 1) -> subprocess.Popen[bytes]:
        """`treadle serve --headless` for engines `rank`.. of `size` (the second "host")."""
        command = [TREADLE, "serve", self.model, *self.common(size, local), "-dpr", str(rank)]
        with open(self.log(rank), "w") as log:
            proc = subprocess.Popen(
                [*command, "--headless"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(
                    os.environ,
                    TREADLE_RPC_BASE_PATH=str(self.head.rpc_dir),
                    TREADLE_HOST_IP="127.0.0.2",
                    TREADLE_LOGGING_LEVEL="INFO",
                ),
            )
        self.headless.append(proc)
        return proc

    def log(self, rank: int) -> Path:
        return self.tmp / f"headless{rank}.log"

    def stop(self) -> None:
        self.head.stop()
        for proc in self.headless:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    """(The acceptance's layout: `-dp 2 -dpl 1` runs two API servers by default.)"""
    c = Cluster(str(tiny_model_factory("llama")), tmp_path_factory.mktemp("scale-headless"))
    try:
        c.head.wait_healthy()
        yield c
    finally:
        c.stop()


def settled(size: int, scaled: int) -> Callable[[dict[str, Any]], bool]:
    events = {"scaled": scaled} if scaled else {}
    return lambda doc: (
        doc["events"] == events and [e["state"] for e in doc["engines"]] == ["ready"] * size
    )


def wait_for_line(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = threading.Event()
    timer = threading.Timer(timeout, deadline.set)
    timer.start()
    try:
        while text not in path.read_text():
            assert proc.poll() is None, path.read_text()[-3000:]
            assert not deadline.wait(0.1), path.read_text()[-3000:]
    finally:
        timer.cancel()


def test_scale_out_and_in_with_a_headless_engine_changes_no_text(cluster: Cluster) -> None:
    head = cluster.head
    texts = prompts()
    reference = Streams(head.url, texts).results()  # undisturbed, on two engines
    views = both_views(head, settled(2, 0), timeout=30, headers=AUTH)
    assert [v["events"] for v in views.values()] == [{}, {}]

    # The engine for rank 2 first: the head holds its HELLO (it has no rank 2 yet) and it
    # waits, saying so.
    third = cluster.start_headless(3, 2)
    wait_for_line(head.log_path, "says HELLO for engine rank 2", third, 60)

    # 2 -> 3 while 16 streams run: the held HELLO is answered, rank 2 joins.
    scale_under_streams(head, texts, reference, 2, 3)
    views = both_views(head, settled(3, 1), headers=AUTH)
    assert [engines_of(v) for v in views.values()] == [engines_of(views[0])] * 2
    engine = next(
        c for c in psutil.Process(third.pid).children() if "EngineCore_DP2" in c.cmdline()[0]
    )
    assert views[0]["engines"][2]["pid"] == engine.pid  # the headless one, not ours
    complete_on(head, texts[5], rank=2)  # both API servers route to it
    assert "The DP coordinator now counts 3 engines" in head.output()

    # 3 -> 2 while 16 streams run, some on rank 2: they finish there; then it is released
    # and its headless CLI (which ran only it) exits 0.
    scale_under_streams(head, texts, reference, 3, 2)
    assert third.wait(30) == 0, cluster.log(2).read_text()[-3000:]
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE
    assert "Released by a front end (POST /scale)" in cluster.log(2).read_text()
    views = both_views(head, settled(2, 2), headers=AUTH)
    assert [engines_of(v) for v in views.values()] == [engines_of(views[0])] * 2
    output = head.output()
    since = output.split("Scaling out from 2 to 3")[1].splitlines()
    # Its departure is expected: nobody stops, dies or is lost.
    assert not [line for line in since if "shutting down" in line or "was stopped;" in line]
    assert "Scaled in from 3 to 2 engines" in output
    assert cluster.headless[0].poll() is None  # rank 1's engine serves on
    assert httpx.get(head.url + "/health/ready", timeout=10).status_code == 200


def complete(url: str, prompt: str, rank: int) -> str:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    headers = {**AUTH, "X-data-parallel-rank": str(rank)}
    resp = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def test_one_api_server_scale_first_then_the_engine_and_in_past_the_first_headless(
    tmp_path: Path, tiny_model_factory
) -> None:  # type: ignore[no-untyped-def]
    """The other order, with one API server (`engine_scale.py`), and a headless CLI with two
    engines (ranks 1 and 2 of 3): `POST /scale` to 4 first (it waits for the engine's
    HELLO), then the headless engine for rank 3; 4 -> 2 releases ranks 3 and 2: rank 3's
    CLI exits 0, the other keeps rank 1 serving; 2 -> 1 releases rank 1, and its CLI exits
    0 too."""
    c = Cluster(str(tiny_model_factory("llama")), tmp_path, api_servers=1, size=3, remote=2)
    try:
        c.head.wait_healthy()
        url, prompt = c.head.url, "The quick brown fox"
        reference = complete(url, prompt, 0)
        answers: list[httpx.Response] = []
        asking = threading.Thread(
            target=lambda: answers.append(scale(c.head, {"data_parallel_size": 4}))
        )
        asking.start()
        wait_for_line(c.head.log_path, "Scaling out from 3 to 4", c.headless[0], 60)
        fourth = c.start_headless(4, 3)
        asking.join(120)
        assert answers and answers[0].status_code == 200, answers and answers[0].text
        doc = httpx.get(url + "/topology", headers=AUTH, timeout=30).json()
        assert [e["state"] for e in doc["engines"]] == ["ready"] * 4
        assert complete(url, prompt, 3) == reference

        answer = scale(c.head, {"data_parallel_size": 2})
        assert answer.status_code == 200, answer.text
        assert fourth.wait(30) == 0, c.log(3).read_text()[-3000:]
        assert "stopped (its front end released it); the others serve on" in c.log(1).read_text()
        assert c.headless[0].poll() is None
        assert complete(url, prompt, 1) == reference  # rank 1 serves on there

        answer = scale(c.head, {"data_parallel_size": 1})
        assert answer.status_code == 200, answer.text
        assert c.headless[0].wait(30) == 0, c.log(1).read_text()[-3000:]
        doc = httpx.get(url + "/topology", headers=AUTH, timeout=30).json()
        assert [e["state"] for e in doc["engines"]] == ["ready"]
        assert "lost" not in doc["events"] and "died" not in doc["events"]
        assert complete(url, prompt, 0) == reference
        assert "was stopped; stopping" not in c.head.output()
        assert scale(c.head, {"data_parallel_size": 0}).status_code == 400
    finally:
        c.stop()
