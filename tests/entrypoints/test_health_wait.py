"""`/health` 200 means "send work now" (issue 42 item 1, ARCHITECTURE §5): a client that
starts `treadle serve`, polls `/health` every 0.05 s until 200 (as vLLM's docs, Kubernetes
and most scripts wait) and then sends a request is served, with one API server and with
`-dp 2` (two API servers under a supervisor). Several starts per layout: the request lands
moments after the first 200, where a start-up that said 200 too early answers 503. Before
that 200 every answer is llama-server's "Loading model" 503 with the phase. Each start
ends with a SIGTERM, and the log says what it should of the start and the stop."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_startup_probe import wait_for_url

from serve_helpers import RemoteServer

LAYOUTS = {"1-api-server": ([], 3), "dp2": (["-dp", "2"], 2)}


def wait_then_request(srv: RemoteServer) -> tuple[list[tuple[int, Any]], int, str]:
    """/health every 0.05 s until 200, then a completion at once: (every /health answer
    before the 200 as (status, body), the completion's status, its text)."""
    deadline = time.monotonic() + 180
    wait_for_url(srv, deadline)
    before = []
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        while True:
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.output()
            live = client.get("/health")
            if live.status_code == 200:
                break
            before.append((live.status_code, live.json()))
            time.sleep(0.05)
        resp = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    return before, resp.status_code, resp.text


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_first_request_after_health_200_is_served(  # type: ignore[no-untyped-def]
    layout: str, tmp_path: Path, tiny_model_factory
) -> None:
    extra, starts = LAYOUTS[layout]
    args = [str(tiny_model_factory("llama")), "--max-model-len", "128", *extra]
    for start in range(starts):
        (workdir := tmp_path / f"start{start}").mkdir()
        srv = RemoteServer(args, workdir, {"TREADLE_LOGGING_LEVEL": "INFO"}, wait=False)
        try:
            try:
                before, status, text = wait_then_request(srv)
            except httpx.HTTPError as e:
                raise AssertionError(f"{e!r}; the server's log:\n{srv.output()}") from e
            assert status == 200, (start, text, srv.output())
            for code, body in before:
                assert code == 503, body
                assert body["error"] == {
                    "message": "Loading model",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": 503,
                }
                assert body["status"] == "starting" and body["phase"], body
            srv.proc.send_signal(signal.SIGTERM)
            assert srv.proc.wait(60) == 0, srv.output()
            check_start_and_stop_lines(srv.output(), srv.url, supervised=bool(extra))
        finally:
            srv.stop()


def check_start_and_stop_lines(log: str, url: str, supervised: bool) -> None:
    """What the log says (issue 42 items 5 and 9): one "Ready" line with the URLs; one line
    per load phase with its time, no progress bar; one "Received SIGTERM" for one signal."""
    ready = f"Ready: the OpenAI API at {url}/v1, the chat page at {url}/, the dashboard at {url}/dashboard"
    assert log.count(ready) == 1, log
    assert re.search(r"Read \d+ tensors from \S+ in \d+\.\d s", log), log
    assert re.search(r"Model runs on .* \(layers prepared in \d+\.\d s\)", log), log
    assert "Loading GGUF" not in log and "it/s]" not in log, log
    received = [line for line in log.splitlines() if "Received SIGTERM" in line]
    assert len(received) == (1 if supervised else 0), received  # (uvicorn stops one server)
