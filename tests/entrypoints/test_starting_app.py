"""`StartingServer` as ASGI, without processes: while the engines load a request and a probe
get 503 at once; once every engine connects (`handshake`) both wait for the full app and are
answered by it (several API servers finish moments apart)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
from fastapi import FastAPI

from treadle.entrypoints.openai.cli_args import FrontendArgs
from treadle.entrypoints.openai.starting import EngineStart, StartingServer
from treadle.frontend.startup import StartupProgress
from treadle.wire.control import StartupPhase


def _full_app(engine: Any) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, str]:
        return {"served_by": "the full app"}

    return app


def _starting(build: Any, progress: StartupProgress) -> StartingServer:
    """The ASGI app of an API server whose engine client `build` makes (an object here: only
    handed to `_full_app`)."""
    return StartingServer(
        EngineStart(build, progress),
        _full_app,
        FrontendArgs(),
        None,
        stop_serving=lambda: None,
        on_engine=lambda engine: None,
    )


async def _scenario() -> dict[str, Any]:
    progress = StartupProgress(2)
    gate = threading.Event()

    def build() -> Any:
        gate.wait(30)
        return object()  # (the engine client: only handed to `_full_app`)

    server = _starting(build, progress)
    inbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    lifespan = asyncio.create_task(server({"type": "lifespan"}, inbox.get, send))
    seen: dict[str, Any] = {}
    transport = httpx.ASGITransport(app=server)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        progress.report(0, StartupPhase.LOADING_WEIGHTS)
        seen["loading"] = (await client.get("/v1/models")).status_code
        seen["probe"] = (await client.get("/health/startup")).status_code  # at once
        for rank in (0, 1):
            progress.report(rank, StartupPhase.HANDSHAKE)
        held = asyncio.create_task(client.get("/v1/models"))
        held_probe = asyncio.create_task(client.get("/health/startup"))
        await asyncio.sleep(0.3)
        seen["held_done_early"] = held.done() or held_probe.done()
        gate.set()
        seen["held"] = (await asyncio.wait_for(held, 10)).json()
        # (the full app of this test has no /health/startup: its 404, not the starting 503)
        seen["held_probe"] = (await asyncio.wait_for(held_probe, 10)).status_code
    await inbox.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(lifespan, 10)
    seen["lifespan"] = [m["type"] for m in sent]
    return seen


def test_a_request_while_the_engines_connect_waits_for_the_full_app() -> None:
    seen = asyncio.run(_scenario())
    assert seen["loading"] == 503
    assert seen["held_done_early"] is False
    assert seen["probe"] == 503
    assert seen["held"] == {"served_by": "the full app"}
    assert seen["held_probe"] == 404
    assert seen["lifespan"] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


async def _follower_scenario() -> dict[str, Any]:
    """An API server that copies the supervisor's phases (`follows`) holds a probe until the
    first copy came, then answers with it (not with its own `starting`)."""
    progress = StartupProgress(1, follows=True)
    gate = threading.Event()
    server = _starting(lambda: gate.wait(30) and object(), progress)
    inbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    lifespan = asyncio.create_task(server({"type": "lifespan"}, inbox.get, _ignore))
    seen: dict[str, Any] = {}
    transport = httpx.ASGITransport(app=server)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        probe = asyncio.create_task(client.get("/health/startup"))
        await asyncio.sleep(0.3)
        seen["done_early"] = probe.done()
        progress.report(0, StartupPhase.LOADING_WEIGHTS)  # as `follow_phases` copies it
        progress.heard.set()
        answer = await asyncio.wait_for(probe, 10)
        seen["probe"] = (answer.status_code, answer.json()["engines"][0]["phase"])
    gate.set()
    await inbox.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(lifespan, 10)
    return seen


async def _ignore(message: dict[str, Any]) -> None:
    pass


def test_a_follower_holds_a_probe_until_it_heard_the_phases() -> None:
    seen = asyncio.run(_follower_scenario())
    assert seen["done_early"] is False
    assert seen["probe"] == (503, "loading weights")
