"""Engine death loses nothing (issue 14): a killed or crashed engine core is restarted with the
same config and every stream it had continues exactly where its client was; a request that
kills the engine twice is failed instead; /health/ready says whether the engines make
progress; a crash loop still ends the server."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI
from test_leftovers import push_forged_control_frames

from serve_helpers import TREADLE, RemoteServer, assert_no_leftovers

POISON_TOKEN = 49000  # the fault hook crashes the engine on a prompt holding it
RAISE_TOKEN = 49001  # the other one makes it raise in its step
STREAMS = 16
MAX_TOKENS = 96
STALL_S = 5  # a prefill step on two loaded cores may take seconds


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    srv = RemoteServer(
        [
            "--dtype", "float32", "--max-engine-restarts", "10",
            "--engine-stall-timeout", str(STALL_S), "--engine-stall-kill-timeout", "20",
        ],
        tmp_path_factory.mktemp("restart"),
        env={
            "TREADLE_TEST_CRASH_ON_TOKEN": str(POISON_TOKEN),
            "TREADLE_TEST_RAISE_ON_TOKEN": str(RAISE_TOKEN),
        },
    )  # fmt: skip
    yield srv
    srv.stop()


def prompts(n: int) -> list[str]:
    return [
        f"Write a story about a {w} number {i}."
        for i, w in zip(range(n), "abcdefghijklmnop", strict=False)
    ]


class Streams:
    """n greedy completion streams in threads, each collecting its text and usage."""

    def __init__(self, url: str, texts: list[str], max_tokens: int = MAX_TOKENS) -> None:
        self.client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        self.tokens = [0] * len(texts)
        self.pool = concurrent.futures.ThreadPoolExecutor(len(texts))
        self.futures = [
            self.pool.submit(self._one, i, text, max_tokens) for i, text in enumerate(texts)
        ]

    def _one(self, i: int, prompt: str, max_tokens: int) -> tuple[str, int]:
        stream = self.client.completions.create(
            model=self.client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", 0
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                self.tokens[i] += 1
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage

    def wait_all_started(self, tokens: int = 3, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while min(self.tokens) < tokens:
            assert time.monotonic() < deadline, f"streams stuck at {self.tokens}"
            for f in self.futures:
                if f.done():
                    f.result()  # raises the stream's error
            time.sleep(0.05)

    def results(self, timeout: float = 300) -> list[tuple[str, int]]:
        out = [f.result(timeout) for f in self.futures]
        self.pool.shutdown()
        return out


def engine_pid(server: RemoteServer) -> int | None:
    try:
        return server.pid_of("treadle::EngineCore_DP0")
    except LookupError:  # between a death and its restart
        return None


def wait_ready(server: RemoteServer, timeout: float) -> float:
    """Seconds until /health/ready answers 200."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if httpx.get(server.url + "/health/ready", timeout=5).status_code == 200:
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"not ready in {timeout} s:\n{server.output()[-3000:]}")


def not_ready_within(server: RemoteServer, timeout: float) -> bool:
    """Whether /health/ready answers 503 within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/health/ready", timeout=5).status_code == 503:
            return True
        time.sleep(0.05)
    return False


def metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    values = re.findall(rf"^treadle:{name}\{{[^}}]*\}} ([\d.e+]+)$", text, re.M)
    return sum(float(v) for v in values)


def test_kill_9_of_the_engine_core_twice_resumes_every_stream(server: RemoteServer) -> None:
    texts = prompts(STREAMS)
    reference = Streams(server.url, texts).results()
    assert all(n == MAX_TOKENS for _, n in reference)
    restarts = metric(server, "engine_restarts_total")
    streams = Streams(server.url, texts)
    for kill in range(2):
        streams.wait_all_started(tokens=5 + 20 * kill)
        os.kill(server.pid_of("treadle::EngineCore_DP0"), signal.SIGKILL)
        time.sleep(0.5)
        assert httpx.get(server.url + "/health/ready").status_code == 503
        assert httpx.get(server.url + "/health").status_code == 200  # alive: restarting
        wait_ready(server, timeout=60)
    assert streams.results() == reference  # the same text, and usage counts every token
    assert metric(server, "engine_restarts_total") == restarts + 2
    assert metric(server, "requests_resumed_total") >= 2 * STREAMS - 4
    log = server.output()
    assert "is back" in log and "resuming" in log
    assert Streams(server.url, texts[:1]).results() == reference[:1]  # still serving


def test_forged_control_frames_change_nothing_and_sigterm_to_the_engine_alone_is_a_death(
    server: RemoteServer,
) -> None:
    """Issue 42 item 9: a forged ENGINE_CORE_STOPPED stopped the whole server (exit 0), and a
    forged death report was blamed on the next real death; a SIGTERM to the engine core alone
    stopped the server too. Now the forgeries are refused (logged) and the SIGTERM is a death:
    restarted, its streams resumed with the very text."""
    texts = prompts(4)
    reference = Streams(server.url, texts, max_tokens=400).results()
    refused = server.output().count("on the output socket")
    assert push_forged_control_frames(server.rpc_dir) >= 1
    deadline = time.monotonic() + 10
    while server.output().count("on the output socket") < refused + 4:
        assert time.monotonic() < deadline and server.proc.poll() is None, server.output()
        time.sleep(0.05)
    restarts = metric(server, "engine_restarts_total")
    streams = Streams(server.url, texts, max_tokens=400)
    streams.wait_all_started()
    pid = server.pid_of("treadle::EngineCore_DP0")
    os.kill(pid, signal.SIGTERM)  # it serves on while it waits for its front end to ask
    assert min(streams.tokens) < 300, streams.tokens  # (so the streams outlive it)
    assert streams.results() == reference
    deadline = time.monotonic() + 30  # (the streams may end within its 3 s of grace)
    while engine_pid(server) in (pid, None):
        assert time.monotonic() < deadline and server.proc.poll() is None, server.output()
        time.sleep(0.1)
    wait_ready(server, timeout=60)
    assert engine_pid(server) != pid and server.proc.poll() is None
    assert metric(server, "engine_restarts_total") == restarts + 1
    death = httpx.get(server.url + "/topology", timeout=30).json()["engines"][0]["last_death"]
    assert "SIGTERM was sent to this engine core alone" in death["error"], death
    assert "forged" not in server.output()


def test_a_request_that_crashes_the_engine_twice_fails_and_the_others_resume(
    server: RemoteServer,
) -> None:
    texts = prompts(4)
    reference = Streams(server.url, texts).results()
    poisoned = metric(server, "requests_failed_poison_total")
    streams = Streams(server.url, texts)
    streams.wait_all_started()
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"model": "SmolLM2-135M-Instruct", "prompt": [1, 2, POISON_TOKEN], "max_tokens": 4},
        timeout=120,
    )
    assert resp.status_code == 500 and "died twice" in resp.json()["error"]["message"]
    assert streams.results() == reference
    assert metric(server, "requests_failed_poison_total") == poisoned + 1
    wait_ready(server, timeout=60)


def test_an_engine_that_raises_says_why_in_the_error_the_topology_and_the_log(
    server: RemoteServer,
) -> None:
    raised = "RuntimeError: TREADLE_TEST_RAISE_ON_TOKEN: raising on"
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"model": "SmolLM2-135M-Instruct", "prompt": [1, 2, RAISE_TOKEN], "max_tokens": 4},
        timeout=120,
    )  # it kills the engine, is resumed, kills it again: it fails with the second death
    message = resp.json()["error"]["message"]
    assert resp.status_code == 500 and "died twice" in message and raised in message, message
    assert "the EngineCore_DP0 process died: exit code 1; it raised" in message
    wait_ready(server, timeout=60)
    death = httpx.get(server.url + "/topology", timeout=30).json()["engines"][0]["last_death"]
    assert death["cause"] == "the EngineCore_DP0 process died: exit code 1"
    assert death["error"].startswith(raised)
    assert death["frames"][-1].startswith("engine_core.py:"), death
    assert any("Engine ready" in line for line in death["log_tail"]), death
    lines = [line for line in server.output().splitlines() if "Restarting it" in line]
    assert sum(raised in line and "exit code 1" in line for line in lines) == 2, lines


def test_a_stopped_engine_is_not_ready_and_a_long_stall_is_restarted(
    server: RemoteServer,
) -> None:
    texts = prompts(4)
    reference = Streams(server.url, texts, max_tokens=256).results()
    streams = Streams(server.url, texts, max_tokens=256)
    pid = server.pid_of("treadle::EngineCore_DP0")
    for stall in ("short", "long"):
        streams.wait_all_started(tokens=5 if stall == "short" else 30)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            while httpx.get(server.url + "/health/ready").status_code == 200:
                assert time.monotonic() - stopped < STALL_S + 1.5, "ready past the stall timeout"
                time.sleep(0.1)
            assert "finished no step" in httpx.get(server.url + "/health/ready").text
        finally:
            if stall == "short":
                os.kill(pid, signal.SIGCONT)
        wait_ready(server, timeout=60)
        if stall == "short":
            assert engine_pid(server) == pid  # it came back by itself
    # past --engine-stall-kill-timeout it was killed and restarted, and its streams resumed
    assert engine_pid(server) != pid
    assert streams.results() == reference
    assert "finished no step for" in server.output()


def test_a_crash_loop_ends_the_server(server_factory, tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    srv = server_factory([str(tiny_model_factory("llama")), "--max-engine-restarts", "1"])
    pids = [p.pid for p in srv.family()]
    os.kill(srv.pid_of("treadle::EngineCore_DP0"), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while engine_pid(srv) in (*pids, None):
        assert time.monotonic() < deadline, srv.output()
        time.sleep(0.1)
    wait_ready(srv, timeout=60)
    pids.append(engine_pid(srv))
    os.kill(pids[-1], signal.SIGKILL)
    assert srv.proc.wait(30) != 0
    assert "--max-engine-restarts" in srv.output()
    assert_no_leftovers(srv, pids)


def test_bad_restart_flags_are_refused(tmp_path: Path) -> None:
    for flags in (
        ["--max-engine-restarts", "-1"],
        ["--engine-stall-timeout", "0"],
        ["--engine-stall-timeout", "10", "--engine-stall-kill-timeout", "5"],
    ):
        out = subprocess.run(
            [TREADLE, "serve", *flags, "--port", "0"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2 and "treadle serve: error:" in out.stderr, flags


def stream_completion(
    url: str, prompt: str, max_tokens: int, rank: int | None = None, gaps: list[float] | None = None
) -> str:
    """A greedy streamed completion's text (pinned to a DP rank if given); `gaps` gets the
    time between consecutive chunks."""
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, last = "", None
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers=headers, timeout=120
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            now = time.monotonic()
            if gaps is not None and last is not None:
                gaps.append(now - last)
            last = now
    return text


def test_a_dead_tp_worker_restarts_its_engine_and_the_stream_goes_on(
    server_factory, tiny_model_factory
) -> None:  # type: ignore[no-untyped-def]
    srv = server_factory([str(tiny_model_factory("llama")), "-tp", "2"])
    reference = stream_completion(srv.url, "hello there", 400)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        gaps: list[float] = []
        future = pool.submit(stream_completion, srv.url, "hello there", 400, None, gaps)
        while len(gaps) < 20:
            assert not future.done(), future.result()
            time.sleep(0.01)
        worker = srv.pid_of("treadle::Worker_TP1")
        os.kill(worker, signal.SIGKILL)
        assert future.result(120) == reference
    assert max(gaps) > 0.5  # it did pause for the restart
    wait_ready(srv, timeout=60)
    assert srv.pid_of("treadle::Worker_TP1") != worker
    assert metric(srv, "engine_restarts_total") == 1
    death = httpx.get(srv.url + "/topology", timeout=30).json()["engines"][0]["last_death"]
    said = f"Worker_TP1 (pid {worker}) died: killed by signal 9 (SIGKILL)"
    assert said in death["error"], death
    assert any(said in line and "Restarting it" in line for line in srv.output().splitlines())
    # The dead worker's reply queue (and those of the ranks killed with it) are removed and
    # forgotten by the resource tracker: no "leaked shared_memory objects" at the end.
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    assert "leaked shared_memory" not in srv.log_path.read_text(), srv.output()[-3000:]


def streams_across_a_kill(
    srv: RemoteServer, victim: int, reference: str, after_kill: Callable[[], bool] = lambda: True
) -> list[list[float]]:
    """A stream on each of engines 0 and 1; kill -9 of `victim` once both are under way, then
    `after_kill()` must hold; both texts must be `reference`. Returns each stream's gaps."""
    gaps: list[list[float]] = [[], []]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(stream_completion, srv.url, "hello there", 400, rank, gaps[rank])
            for rank in (0, 1)
        ]
        while min(len(g) for g in gaps) < 20:
            assert not any(f.done() for f in futures), [f.result() for f in futures]
            time.sleep(0.01)
        os.kill(victim, signal.SIGKILL)
        assert after_kill()
        assert [f.result(120) for f in futures] == [reference, reference]
    return gaps


@pytest.mark.parametrize("api_servers", ["1", "2"])  # 2: the supervisor restarts it
def test_one_dead_engine_of_two_does_not_pause_the_other_nor_a_dead_coordinator(
    server_factory, tiny_model_factory, api_servers: str
) -> None:  # type: ignore[no-untyped-def]
    srv = server_factory(
        [str(tiny_model_factory("llama")), "-dp", "2", "--api-server-count", api_servers]
    )
    reference = stream_completion(srv.url, "hello there", 400, rank=0)
    victim = srv.pid_of("treadle::EngineCore_DP1")
    # Every API server sees the death at once (not when the new engine says hello, seconds on).
    gaps = streams_across_a_kill(srv, victim, reference, lambda: not_ready_within(srv, 1.0))
    pause = max(gaps[1])  # engine 1's stream waited for its restart ...
    assert pause > 1.0
    assert max(gaps[0]) < pause / 2  # ... engine 0's did not
    wait_ready(srv, timeout=60)
    assert metric(srv, "engine_restarts_total") == 1  # counted once, whoever saw it

    # The DP coordinator holds no request: a new one takes its addresses, no stream pauses.
    coordinator = srv.pid_of("treadle::DPCoordinator")
    gaps = streams_across_a_kill(srv, coordinator, reference)
    assert max(max(g) for g in gaps) < pause / 2
    deadline = time.monotonic() + 30
    while "DPCoordinator is back" not in srv.output():
        assert time.monotonic() < deadline, srv.output()[-3000:]
        time.sleep(0.1)
    assert srv.pid_of("treadle::DPCoordinator") != coordinator
    assert stream_completion(srv.url, "hello there", 400) == reference  # routed again
    wait_ready(srv, timeout=10)
    if api_servers == "2":  # a normal stop: no engine core blames a message's size
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        log = srv.log_path.read_text()
        assert not re.search(r"\(EngineCore_DP\d pid=\d+\).*MAX_MSG_BYTES", log), log[-3000:]


def streams_on_api_server_0(srv: RemoteServer) -> int:
    """How many HTTP connections of the server's port APIServer_0 holds."""
    port = int(srv.url.rsplit(":", 1)[1])
    conns = psutil.Process(srv.pid_of("treadle::APIServer_0")).net_connections(kind="tcp")
    return sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port for c in conns)


def test_an_engine_that_stalls_twice_under_two_api_servers_is_killed_both_times(
    server_factory, tiny_model_factory
) -> None:  # type: ignore[no-untyped-def]
    """With several API servers the supervisor restarts the engine, and API server 0 kills it
    when it stalls: each time, not only the first (its first kill once stayed on record, as
    only a client that restarts its own engines cleared it, so a second stall was never
    killed and the server stayed not ready)."""
    srv = server_factory(
        [
            str(tiny_model_factory("llama")),
            *("--api-server-count", "2", "--engine-stall-timeout", "1"),
            *("--engine-stall-kill-timeout", "3"),
        ]
    )
    tokens = 480  # (the tiny model's 512 positions: as long as a stream may run)
    reference = stream_completion(srv.url, "hello there", tokens)
    gaps: list[list[float]] = []
    futures: list[concurrent.futures.Future[str]] = []
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        # Only API server 0 kills: it must hold a stream (the kernel picks who accepts).
        while len(futures) < 4 or streams_on_api_server_0(srv) == 0:
            assert len(futures) < 12, "APIServer_0 accepted none of 12 streams"
            gaps.append([])
            futures.append(
                pool.submit(stream_completion, srv.url, "hello there", tokens, None, gaps[-1])
            )
            while len(gaps[-1]) < 3:
                assert not futures[-1].done(), futures[-1].result()
                time.sleep(0.01)
        for stall in (1, 2):
            seen = [len(g) for g in gaps]  # every stream runs on this engine process
            while True:  # the streams still running have moved on (a fast one may be done)
                running = [i for i, f in enumerate(futures) if not f.done()]
                assert running, f"every stream finished before stall {stall}"
                if all(len(gaps[i]) >= seen[i] + 5 for i in running):
                    break
                time.sleep(0.01)
            assert streams_on_api_server_0(srv), f"APIServer_0's streams ended before stall {stall}"
            pid = srv.pid_of("treadle::EngineCore_DP0")
            os.kill(pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 60
                while engine_pid(srv) in (pid, None):
                    assert time.monotonic() < deadline, f"stall {stall} was not killed"
                    time.sleep(0.1)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert [f.result(120) for f in futures] == [reference] * len(futures)
    wait_ready(srv, timeout=60)
    assert srv.output().count("finished no step for") >= 2
    assert metric(srv, "engine_restarts_total") == 2


def test_an_engine_whose_restart_fails_is_lost_while_the_other_serves(
    server_factory, tiny_model_factory
) -> None:  # type: ignore[no-untyped-def]
    """A local engine that cannot be started again is `lost` as a remote one is: its stream
    resumes on the other engine, which serves on; a request pinned to it gets 503,
    /health/ready 503 saying so, /topology says why. The loss of the last one ends it."""
    srv = server_factory(
        [str(tiny_model_factory("llama")), "-dp", "2", "--api-server-count", "1"],
        env={"TREADLE_TEST_FAIL_RESTART_RANK": "1"},
    )
    reference = stream_completion(srv.url, "hello there", 300, rank=0)
    gaps: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream_completion, srv.url, "hello there", 300, 1, gaps)
        while len(gaps) < 5:
            assert not future.done(), future.result()
            time.sleep(0.01)
        os.kill(srv.pid_of("treadle::EngineCore_DP1"), signal.SIGKILL)
        assert future.result(120) == reference  # resumed on engine 0
    output = srv.output()
    assert "TREADLE_TEST_FAIL_RESTART_RANK" in output
    assert "EngineCore_DP1 is lost, the others serve on" in output, output[-3000:]
    assert stream_completion(srv.url, "hello there", 300) == reference  # engine 0 serves on
    pinned = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2},
        headers={"X-data-parallel-rank": "1"},
        timeout=30,
    )
    assert pinned.status_code == 503 and "lost" in pinned.json()["error"]["message"]
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    ready = httpx.get(srv.url + "/health/ready", timeout=10)
    assert ready.status_code == 503 and "engine core 1 is lost" in ready.text
    engines = httpx.get(srv.url + "/topology", timeout=30).json()["engines"]
    assert [e["state"] for e in engines] == ["ready", "lost"]
    assert "restarting it failed" in engines[1]["last_death"]["cause"]
    with contextlib.suppress(LookupError):  # its failed restart was stopped, not left behind
        pytest.fail(f"a DP1 process is left: pid {srv.pid_of('treadle::EngineCore_DP1')}")
