"""One engine event between processes (issue 43, `frontend/engine_events.py`): with two API
servers under the supervisor, kill -9 of an engine core, a stall kill and a lost engine each
produce exactly one event that both API servers apply (`/topology`'s `events`, counted by
each API server), and `/topology` says the same of the engines from either API server (the
cause of the last death included).

One server for the module, its tests in file order (the counts add up): engine 0 is killed
(-9), then stopped until the stall watch has it killed; engine 1's restart fails (a test
hook), so it is lost."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest
from test_engine_restart import stream_completion

from serve_helpers import RemoteServer, both_views, engines_of


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory) -> Iterator[RemoteServer]:  # type: ignore[no-untyped-def]
    server = RemoteServer(
        [str(tiny_model_factory("llama")), "-dp", "2", "--api-server-count", "2",
         "--max-engine-restarts", "5", "--engine-stall-timeout", "1",
         "--engine-stall-kill-timeout", "3"],
        tmp_path_factory.mktemp("engine-events"),
        env={"TREADLE_TEST_FAIL_RESTART_RANK": "1"},
    )  # fmt: skip
    yield server
    server.stop()


def test_a_killed_engine_is_one_event_that_both_api_servers_apply(srv: RemoteServer) -> None:
    views = both_views(srv, lambda doc: True)
    assert [v["events"] for v in views.values()] == [{}, {}]
    os.kill(srv.pid_of("treadle::EngineCore_DP0"), signal.SIGKILL)
    views = both_views(
        srv,
        lambda doc: doc["events"] == {"died": 1} and doc["engines"][0]["state"] == "ready",
    )
    first, second = engines_of(views[0]), engines_of(views[1])
    assert first == second
    death = first[0]["last_death"]
    assert death is not None and "killed by signal 9" in death["cause"], death


def test_a_stall_kill_is_one_event_that_both_api_servers_apply(srv: RemoteServer) -> None:
    reference = stream_completion(srv.url, "hello there", 400, rank=0)
    gaps: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream_completion, srv.url, "hello there", 400, 0, gaps)
        while len(gaps) < 5:
            assert not future.done(), future.result()
            time.sleep(0.01)
        pid = srv.pid_of("treadle::EngineCore_DP0")
        os.kill(pid, signal.SIGSTOP)  # it has a request and makes no step
        try:
            views = both_views(
                srv,
                lambda doc: doc["events"] == {"died": 2} and doc["engines"][0]["state"] == "ready",
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert future.result(120) == reference  # resumed on the new process
    first, second = engines_of(views[0]), engines_of(views[1])
    assert first == second
    cause = first[0]["last_death"]["cause"]
    assert "finished no step for" in cause and "killed (" in cause, cause


def test_a_lost_engine_is_one_event_that_both_api_servers_apply(srv: RemoteServer) -> None:
    os.kill(srv.pid_of("treadle::EngineCore_DP1"), signal.SIGKILL)  # its restart fails
    views = both_views(
        srv,
        lambda doc: (
            doc["events"] == {"died": 3, "lost": 1} and doc["engines"][1]["state"] == "lost"
        ),
    )
    first, second = engines_of(views[0]), engines_of(views[1])
    assert first == second
    cause = first[1]["last_death"]["cause"]
    assert "restarting it failed" in cause and "is lost" in cause, cause
    # The others serve on, and nothing is said again: the counts stay.
    assert stream_completion(srv.url, "hello there", 20)
    time.sleep(1.5)
    views = both_views(srv, lambda doc: True)
    assert [v["events"] for v in views.values()] == [{"died": 3, "lost": 1}] * 2
