"""Every health answer of one API server, while its engines start and once they serve
(ARCHITECTURE §5): the starting app (`starting.py`) and the full app (`api_server.py`) both
register `add_health_routes`, so a probe reads the same rules whichever app takes it.

| probe                       | starting                       | serving                          |
|-----------------------------|--------------------------------|----------------------------------|
| `/health`, `/ping` liveness | 503 "Loading model" + phase    | 200 (no body, as vLLM), or 503   |
|                             | (llama-server's answer)        | EngineDeadError: dead for good   |
|                             |                                | or silent past the stall kill    |
| `/health/ready` readiness   | 503 "not ready: the engine is  | 200 {"status": "ready"}, or 503  |
|                             | starting: <phase>"             | saying which engine and why      |
| `/health/startup`           | 503 + each engine's phase      | 200 {"status": "ready", engines} |

`/health` 200 means "send work now": a client that waits for it (every 0.05 s) and then
sends a request is served. A restart in progress keeps it 200 (the request waits for the
engine). A start-up that failed answers 503 EngineDeadError everywhere. A 503 that means "not
yet" is a `ServiceUnavailableError` with Retry-After; one that means "never again" an
`EngineDeadError`. None of them waits for an engine: each answers from what this API server
knows (the engine client's state, `AsyncLLM.liveness/readiness`, and the start-up's phases).
With several API servers each answers for itself; one that is still starting while another
serves holds a request once the engines connect (`StartingServer`), so a 200 from one is not
contradicted by the next request landing on the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from treadle.entrypoints.openai.errors import error_body
from treadle.entrypoints.openai.openapi_responses import NO_CONTENT, errors
from treadle.frontend.async_llm import AsyncLLM
from treadle.frontend.startup import StartupProgress

RETRY = {"Retry-After": "5"}
"""On every "not yet" 503: when to ask again."""

LOADING = "Loading model"
"""llama-server's message while it starts, which its users' scripts match."""

UNAVAILABLE = "ServiceUnavailableError"
DEAD = "EngineDeadError"


class Ready(BaseModel):
    status: str


class EnginePhase(BaseModel):
    dp_rank: int
    phase: str


class Started(BaseModel):
    status: str
    engines: list[EnginePhase]


class Health:
    """The answers of one API server. `engine`: its engine client once built (None while the
    engines start); `failure`: why the start-up failed, if it did."""

    def __init__(
        self,
        progress: StartupProgress,
        engine: AsyncLLM | None = None,
        failure: Callable[[], BaseException | None] = lambda: None,
    ) -> None:
        self.progress = progress
        self.engine = engine
        self.failure = failure

    def starting(self) -> str:
        """What a request gets while the engines start (or after their start-up failed)."""
        error = self.failure()
        if error is not None:
            return f"the engine failed to start: {error}"
        return f"the engine is starting: {self.progress.describe()}"

    def _failed(self) -> Response | None:
        if self.failure() is None:
            return None
        return unavailable(self.starting(), DEAD)

    def live(self) -> Response:
        """Liveness: 200 while this server should be left running."""
        if self.engine is None:
            if (failed := self._failed()) is not None:
                return failed
            body = error_body(LOADING, 503, UNAVAILABLE)
            body.update(status="starting", phase=self.progress.describe())
            return JSONResponse(body, status_code=503, headers=RETRY)
        why = self.engine.liveness()
        if why is None:
            return Response(status_code=200)
        return unavailable(why, DEAD)

    def ready(self) -> Response:
        """Readiness: 200 when every engine is up and makes progress."""
        if self.engine is None:
            return self._failed() or unavailable(f"not ready: {self.starting()}")
        why = self.engine.readiness()
        if why is None:
            return JSONResponse({"status": "ready"})
        return unavailable(
            f"not ready: {why}", DEAD if self.engine.client.dead_reason else UNAVAILABLE
        )

    def startup(self) -> Response:
        """Start-up: 200 once every engine has loaded and connected, else each one's phase."""
        engines = self.progress.to_json()
        if self.engine is not None:
            return JSONResponse({"status": "ready", "engines": engines})
        kind = UNAVAILABLE if self.failure() is None else DEAD
        body = error_body(self.starting(), 503, kind)
        body.update(status="starting", engines=engines)
        return JSONResponse(body, status_code=503, headers=RETRY)


def unavailable(message: str, kind: str = UNAVAILABLE) -> JSONResponse:
    """A 503 in OpenAI's error shape; "not yet" ones say when to ask again."""
    headers = RETRY if kind == UNAVAILABLE else None
    return JSONResponse(error_body(message, 503, kind), status_code=503, headers=headers)


def add_health_routes(app: FastAPI, health: Health) -> None:
    """`/health`, `/ping`, `/health/ready` and `/health/startup`, answered by `health`."""
    probe: dict[int | str, dict[str, Any]] = {200: NO_CONTENT, **errors(503)}

    @app.get("/health", response_class=Response, responses=probe)
    async def live() -> Response:
        """Liveness: 503 "Loading model" while the engines start; 200 once every engine is
        ready, and after that while none is dead for good or silent past
        --engine-stall-kill-timeout (a restart in progress stays 200)."""
        return health.live()

    @app.api_route("/ping", methods=["GET", "POST"], response_class=Response, responses=probe)
    async def ping() -> Response:
        """SageMaker's health check (as vLLM serves it): /health."""
        return health.live()

    @app.get("/health/ready", response_model=Ready, responses=errors(503))
    async def ready() -> Response:
        """Readiness: every engine core is up, has resumed what it had after a restart, and
        shows signs of life (finished steps while it has requests, answers to health pings)
        within --engine-stall-timeout."""
        return health.ready()

    @app.get("/health/startup", response_model=Started, responses=errors(503))
    async def startup() -> Response:
        """Start-up: 200 once every engine has loaded and connected; before that, 503 with
        each engine's phase."""
        return health.startup()
