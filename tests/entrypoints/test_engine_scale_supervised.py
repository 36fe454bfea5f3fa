"""`POST /scale` with two API servers (issue 42 item 3, `cli/supervised_scale.py` and
`frontend/scale_follow.py`): 2 -> 3 -> 2 engines while 16 greedy streams run, every text the
undisturbed run's; each scale is exactly one event (`scaled`) that both API servers apply,
and `/topology` says the same of the engines from either API server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psutil
import pytest
from test_engine_scale import AUTH, KEY, Streams, complete_on, prompts, scale, scale_under_streams

from serve_helpers import RemoteServer, both_views, engines_of


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory) -> Iterator[RemoteServer]:  # type: ignore[no-untyped-def]
    server = RemoteServer(
        [str(tiny_model_factory("llama")), "-dp", "2", "--api-server-count", "2",
         "--api-key", KEY, "--max-engine-restarts", "5"],
        tmp_path_factory.mktemp("scale-supervised"),
        env={"TREADLE_LOGGING_LEVEL": "INFO"},
    )  # fmt: skip
    yield server
    server.stop()


def settled(size: int, scaled: int) -> Callable[[dict[str, Any]], bool]:
    events = {"scaled": scaled} if scaled else {}
    return lambda doc: (
        doc["events"] == events and [e["state"] for e in doc["engines"]] == ["ready"] * size
    )


def test_scale_out_and_in_with_two_api_servers_changes_no_text(srv: RemoteServer) -> None:
    texts = prompts()
    reference = Streams(srv.url, texts).results()  # undisturbed, on two engines
    views = both_views(srv, settled(2, 0), timeout=30, headers=AUTH)
    assert [v["events"] for v in views.values()] == [{}, {}]

    # 2 -> 3 while 16 streams run.
    scale_under_streams(srv, texts, reference, 2, 3)
    views = both_views(srv, settled(3, 1), headers=AUTH)
    assert [engines_of(v) for v in views.values()] == [engines_of(views[0])] * 2
    new_pid = srv.pid_of("treadle::EngineCore_DP2")
    # Both API servers route to the new rank: a request pinned there, to each.
    complete_on(srv, texts[5], rank=2)
    output = srv.output()
    assert "The DP coordinator now counts 3 engines" in output

    # 3 -> 2 while 16 streams run, some of them on rank 2: they finish there.
    scale_under_streams(srv, texts, reference, 3, 2)
    views = both_views(srv, settled(2, 2), headers=AUTH)
    assert [engines_of(v) for v in views.values()] == [engines_of(views[0])] * 2
    assert not psutil.pid_exists(new_pid) or psutil.Process(new_pid).status() == "zombie"
    assert "Scaled in from 3 to 2 engines" in srv.output()
    since = srv.output().split("Scaling out from 2 to 3")[1].splitlines()
    # The removed engine's stop and exit 0, and the old coordinator's, are expected: neither
    # the supervisor nor an API server stops.
    assert not [line for line in since if "APIServerSupervisor" in line and "shutting" in line]
    assert not [line for line in since if "was stopped; stopping" in line]
    # ... and their sockets' peers left on purpose: information, not a warning.
    assert not [line for line in since if "WARNING" in line and "A peer of the" in line]
    assert httpx.get(srv.url + "/health/ready", timeout=10).status_code == 200


def test_bad_scale_requests_are_refused_and_both_serve_on(srv: RemoteServer) -> None:
    for body in ({"data_parallel_size": 0}, {"data_parallel_size": 65}):
        answer = scale(srv, body)
        assert answer.status_code == 400, (body, answer.text)
    same = scale(srv, {"data_parallel_size": 2})
    assert same.status_code == 200, same.text
    views = both_views(srv, settled(2, 2), headers=AUTH)
    assert len(views) == 2
