"""`GET /topology`, `/dashboard` and `/dashboard/events` on one real `-tp 2` server behind
`--api-key` and `--root-path`; the page itself in headless Chromium (DevTools protocol)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chromium import INSTALL_HINT, Chromium, check_screenshot, chromium_path

from serve_helpers import RemoteServer, channel_counts, check_topology

KEY = "dash-s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tp2(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:  # type: ignore[no-untyped-def]
    args = [str(tiny_model_factory("llama")), "-tp", "2", "--api-key", KEY, "--root-path", "/proxy"]
    srv = RemoteServer(args, tmp_path_factory.mktemp("dashboard"))
    yield srv
    srv.stop()


def test_topology_of_tp2_lists_every_process_and_channel(tp2: RemoteServer) -> None:
    topo = check_topology(tp2, AUTH)
    assert sorted(p["title"] for p in topo["processes"]) == [
        "APIServer_0",
        "EngineCore_DP0",
        "Worker_TP0",
        "Worker_TP1",
    ]
    assert channel_counts(topo) == {
        "requests": 1,
        "outputs": 1,
        "shm_broadcast": 1,
        "worker_results": 2,
        "tp_collectives": 1,
    }
    broadcast = next(c for c in topo["channels"] if c["kind"] == "shm_broadcast")
    assert (broadcast["readers"], broadcast["chunks"], len(broadcast["to"])) == (2, 10, 2)
    (engine,) = topo["engines"]
    assert (engine["dp_rank"], engine["state"], engine["tp_size"]) == (0, "ready", 2)
    assert engine["kv_total_blocks"] > 0 and engine["kv_used_blocks"] == 0


def test_the_json_and_the_stream_need_the_key_the_page_does_not(tp2: RemoteServer) -> None:
    for path in ("/topology", "/proxy/topology", "/dashboard/events", "/proxy/v1/models"):
        assert httpx.get(tp2.url + path, timeout=10).status_code == 401, path
    for path in ("/dashboard", "/proxy/dashboard"):
        page = httpx.get(tp2.url + path, timeout=10)
        assert page.status_code == 200 and "<svg" in page.text, path
        assert "http://" not in page.text.replace("http://www.w3.org/2000/svg", "")  # no CDN
    with httpx.stream("GET", tp2.url + "/proxy/dashboard/events", headers=AUTH, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        line = next(line for line in r.iter_lines() if line)
    event = json.loads(line.removeprefix("data: "))
    assert event["api_server"] == 0 and event["engines"][0]["dp_rank"] == 0
    assert {"running", "waiting", "kv_usage", "generated_tokens_per_s", "ttft_p99"} <= set(
        event["engines"][0]
    )


def _stream_completions(server: RemoteServer, count: int, tokens: int) -> list[threading.Thread]:
    def run() -> None:
        body = {"prompt": "hi", "max_tokens": tokens, "ignore_eos": True, "stream": True}
        url = server.url + "/proxy/v1/completions"
        with httpx.stream("POST", url, json=body, headers=AUTH, timeout=120) as r:
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=run, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def test_the_dashboard_draws_the_processes_and_live_charts_in_chromium(
    tp2: RemoteServer, tmp_path: Path
) -> None:
    if chromium_path() is None:
        pytest.fail(INSTALL_HINT)
    topo = check_topology(tp2, AUTH)
    browser = Chromium(tmp_path)
    try:
        browser.page("Page.navigate", url=f"{tp2.url}/proxy/dashboard#key={KEY}")
        nodes = "document.querySelectorAll('#graph g.node').length"
        assert browser.wait_for(f"{nodes} >= {len(topo['processes'])}"), browser.evaluate(
            "document.getElementById('status').textContent"
        )
        drawn: list[list[Any]] = browser.evaluate(
            "Array.from(document.querySelectorAll('#graph g.node'))"
            ".map(n => [n.dataset.role, n.dataset.title, Number(n.dataset.pid)])"
        )
        assert {(t, pid) for _, t, pid in drawn} == {
            (p["title"], p["pid"]) for p in topo["processes"]
        }
        assert {r for r, _, _ in drawn} == {p["role"] for p in topo["processes"]}
        assert browser.evaluate("document.querySelectorAll('#graph line.channel').length") >= 6
        # The key came from the URL fragment: kept for next time, gone from the address bar.
        assert browser.evaluate("localStorage.getItem('treadle-api-key')") == KEY
        assert "#key" not in browser.evaluate("location.href")

        points = "Number(document.getElementById('chart-tokens').dataset.points)"
        assert browser.wait_for(f"{points} >= 1")
        before = browser.evaluate(points)
        threads = _stream_completions(tp2, count=3, tokens=200)
        busy = "window.dashboard.events.some(e => e.engines[0].generated_tokens_per_s > 0)"
        assert browser.wait_for(busy, timeout=60)
        assert browser.wait_for(f"{points} >= {before + 3}", timeout=30)
        assert browser.evaluate("document.querySelectorAll('#chart-tokens path').length") >= 1
        for t in threads:
            t.join(120)
        assert browser.wait_for("window.dashboard.events.some(e => e.engines[0].ttft_p50 > 0)")
        check_screenshot(browser.screenshot(scale=0.5))
    finally:
        browser.close()
