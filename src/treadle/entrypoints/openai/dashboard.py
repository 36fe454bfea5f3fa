"""`GET /topology`, `GET /dashboard` and `GET /dashboard/events`: the deployment as JSON, a
self-contained page that draws it, and the page's live numbers as server-sent events.

The page (`dashboard.html`, package data) needs no key; the JSON and the stream do when
`--api-key` is set (the key middleware of `api_server.py`, `KEYED_PATHS`). The page reads
the stream with `fetch()` (EventSource cannot send the key) and uses relative URLs, so it
works behind `--root-path` and a proxy.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from treadle.frontend.async_llm import AsyncLLM
from treadle.frontend.topology import collect, engine_entry, engine_reports

EVENT_INTERVAL_S = 1.0
KEYED_PATHS = ("/topology", "/dashboard/events")
"""Besides /v1: what `--api-key` guards here."""


def dashboard_page() -> str:
    return resources.files(__package__).joinpath("dashboard.html").read_text(encoding="utf-8")


async def snapshot(engine: AsyncLLM) -> dict[str, Any]:
    """One event of the stream: every engine's load (its `get_topology` report) and this API
    server's TTFT and TPOT percentiles of about the last minute (`LatencyWindow`; with several
    API servers, the latency figures are those of the one that sends the event,
    `api_server`)."""
    states = engine.shown_states()
    reports = await engine_reports(engine, states)
    now = time.monotonic()
    engines = []
    for rank, state in enumerate(states):
        entry = engine_entry(rank, state, reports[rank])
        entry.update(engine.latencies.summary(rank, now))
        engines.append(entry)
    return {"time": time.time(), "api_server": engine.client_index, "engines": engines}


async def event_stream(engine: AsyncLLM, interval: float = EVENT_INTERVAL_S) -> AsyncIterator[str]:
    """One `data:` event per interval until the engines are gone (so that a page left open
    does not hold the server's shutdown)."""
    while not engine.client.ended:
        started = time.monotonic()
        event = await snapshot(engine)
        yield f"data: {json.dumps(event, allow_nan=False)}\n\n"
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))


def add_dashboard_routes(app: FastAPI, engine: AsyncLLM) -> None:
    page = dashboard_page()

    @app.get("/topology")
    async def topology() -> dict[str, Any]:
        """Every process of the deployment, the channels between them, each engine's load
        (and its start-up phase: "ready" by now)."""
        doc = await collect(engine)
        for entry in doc.get("engines", []):
            entry["phase"] = engine.progress.phases[entry["dp_rank"]]
        return doc

    @app.get(  # (not response_class=HTMLResponse: the schema would say errors are HTML too)
        "/dashboard",
        response_class=Response,
        responses={200: {"description": "The page", "content": {"text/html": {}}}},
    )
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get(
        "/dashboard/events",
        response_class=StreamingResponse,
        responses={
            200: {
                "description": "One `data:` event a second, for as long as the server runs",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            }
        },
    )
    async def events() -> StreamingResponse:
        return StreamingResponse(
            event_stream(engine),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
