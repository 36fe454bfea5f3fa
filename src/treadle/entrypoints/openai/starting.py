"""HTTP while the engines start: a single API server serves as soon as its socket is bound, so
that a probe can see how far the start-up got (`frontend/startup.py:StartupProgress`).

`StartingServer` is the ASGI app uvicorn runs. Its lifespan starts a thread that builds the
engine client (`AsyncLLM`: launch, handshake, tokenizer). Until it is built, requests go to a
small app:

    /health, /ping            503 {"error": {"message": "Loading model", ...},
                                   "status": "starting", "phase": "loading weights"}
    /health/startup           503 {"error": ..., "status": "starting", "engines": [phases]}
    /health/ready             503 "not ready: the engine is starting: loading weights"
                              (all three from `health.py`; EngineDeadError once it failed)
    /topology                 this host's processes, each engine "starting" with its "phase"
    /version                  200
    anything else             503 in OpenAI's error shape: "the engine is starting: ..."

except that once every engine is loaded and connecting (`StartupProgress.connecting`), every
request waits (up to `HOLD_S`) for the full app instead: with several API servers, one may be
built moments after another, and what it takes then is answered as the built ones answer.
Likewise an API server that copies the supervisor's phases holds every request until the first
copy came (`StartupProgress.heard`, up to `FIRST_PHASES_S`): before, it would say "starting"
while another API server already said "loading weights".

Then the full app (`build_app`) is built and its lifespan entered in the event loop, and every
request goes to it (its /health/startup answers 200). A start-up that fails stops the server
(`failure` says why: the CLI exits 1 with it); a stop during the start-up terminates the
engine processes (`StartupProgress.stop`), so the thread ends at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

import treadle
from treadle.entrypoints.openai.api_key import add_key_check
from treadle.entrypoints.openai.cli_args import FrontendArgs
from treadle.entrypoints.openai.health import Health, add_health_routes, unavailable
from treadle.frontend.async_llm import AsyncLLM
from treadle.frontend.engine_state import ShownState
from treadle.frontend.startup import StartupProgress
from treadle.frontend.topology import collect
from treadle.logger import init_logger

logger = init_logger(__name__)

STOP_WAIT_S = 30.0
"""How long a stop waits for the start-up thread to end (its engines were terminated)."""

HOLD_S = 10.0
"""How long a request that comes while the engines connect waits for the full app."""

FIRST_PHASES_S = 5.0
"""How long a request waits for the supervisor's first phases (published every 0.5 s)."""


@dataclass(frozen=True)
class EngineStart:
    """How to build the engine client (it blocks until the engines are ready), and where its
    start-up reports its progress."""

    build: Callable[[], AsyncLLM]
    progress: StartupProgress


class StartingServer:
    def __init__(
        self,
        start: EngineStart,
        build_app: Callable[[AsyncLLM], FastAPI],
        server: FrontendArgs,
        announce: str | None,
        stop_serving: Callable[[], None],
        on_engine: Callable[[AsyncLLM], None],
    ) -> None:
        self.start = start
        self.build_app = build_app
        self.announce = announce
        self.stop_serving = stop_serving  # uvicorn's should_exit
        self.on_engine = on_engine  # the engine is built (before any request reaches it)
        self.engine: AsyncLLM | None = None
        self.app: FastAPI | None = None  # the full app, once built
        self.failure: BaseException | None = None  # why the start-up failed (not a stop)
        self.stopping = False
        self.waiting = starting_app(start.progress, server, lambda: self.failure)
        self._thread: threading.Thread | None = None
        self._serving: asyncio.Future[None] | None = None
        self._stack = contextlib.AsyncExitStack()
        self._settled = asyncio.Event()  # the full app is built, or will not be

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        progress = self.start.progress
        if self.app is None and not progress.heard.is_set():
            deadline = time.monotonic() + FIRST_PHASES_S
            while not (progress.heard.is_set() or self._settled.is_set()):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
        if self.app is None and progress.connecting():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), HOLD_S)
        await (self.app or self.waiting)(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self.announce:
                    say_listening(self.announce)
                loop = asyncio.get_running_loop()
                self._thread = threading.Thread(
                    target=self._build, args=(loop,), name="engine-start", daemon=True
                )
                self._thread.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.stopping = True
                if self.app is None:
                    self.start.progress.stop()
                await self._stack.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _build(self, loop: asyncio.AbstractEventLoop) -> None:
        """(The start-up thread.)"""
        try:
            self.engine = self.start.build()
        except BaseException as e:
            if not self.stopping:
                self.failure = e
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    loop.call_soon_threadsafe(self.stop_serving)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._settled.set)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._start_serving)

    def _start_serving(self) -> None:
        self._serving = asyncio.ensure_future(self._serve())  # (kept: a task is weakly held)

    async def _serve(self) -> None:
        """The engine is built: serve the full app."""
        engine = self.engine
        try:
            if self.stopping or engine is None:
                return  # `join` shuts it down
            try:
                self.on_engine(engine)
                app = self.build_app(engine)
                await self._stack.enter_async_context(app.router.lifespan_context(app))
            except Exception as e:
                logger.exception("The API server failed to start serving")
                self.failure = e
                self.stop_serving()
                return
            self.app = app
        finally:
            self._settled.set()

    def join(self) -> AsyncLLM | None:
        """After serving: end the start-up if it still runs; the engine, if it was built."""
        thread = self._thread
        deadline = time.monotonic() + STOP_WAIT_S
        while thread is not None and thread.is_alive() and time.monotonic() < deadline:
            self.start.progress.stop()  # (its children may not have existed at the first stop)
            thread.join(0.5)
        return self.engine


def say_listening(line: str) -> None:
    """Say where the server listens, as uvicorn says it when it opens the socket itself."""
    uvicorn_log = logging.getLogger("uvicorn.error")
    # Above info (--uvicorn-log-level warning) uvicorn would not say it: treadle does.
    (uvicorn_log if uvicorn_log.isEnabledFor(logging.INFO) else logger).info("%s", line)


def starting_app(
    progress: StartupProgress,
    server: FrontendArgs,
    failure: Callable[[], BaseException | None],
) -> FastAPI:
    """What answers while the engines start (the table in the module docstring)."""
    app = FastAPI(title="treadle", openapi_url=None, docs_url=None, redoc_url=None)
    app.root_path = server.root_path
    if server.api_key:
        add_key_check(app, server.api_key, server.root_path)

    health = Health(progress, failure=failure)
    add_health_routes(app, health)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": treadle.__version__}

    @app.get("/topology")
    async def topology() -> dict[str, Any]:
        doc = await collect(_Starting(len(progress.phases)))
        for entry in doc["engines"]:
            entry["phase"] = progress.phases[entry["dp_rank"]]
        return doc

    @app.api_route(
        "/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    )
    async def other(path: str, request: Request) -> Response:
        return unavailable(health.starting())

    return app


class _Starting:
    """What `/topology` reads of engines that have not started yet (`topology.Engines`)."""

    client_index = 0

    def __init__(self, num_engines: int) -> None:
        self.num_engines = num_engines

    def shown_states(self) -> list[ShownState]:
        return [ShownState.STARTING] * self.num_engines

    def last_deaths(self) -> list[dict[str, Any] | None]:
        return [None] * self.num_engines

    def event_counts(self) -> dict[str, int]:
        return {}

    async def topology_report(self, rank: int) -> Any:
        raise RuntimeError(f"engine core {rank} is starting")

    def coordinator_address(self) -> str:
        return ""
