"""The API server: FastAPI routes, OpenAI-style errors, API keys, metrics, and its lifecycle.

With one API server, this runs in the `treadle serve` process itself; it serves HTTP as soon
as its socket is bound while it starts the engine core processes (through `AsyncLLM`, in a
thread: `starting.py`), and exits non-zero if they fail to start or die. With several, each
builds its engine client first (the supervisor starts the engines), then serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

import treadle
from treadle.config import EngineConfig
from treadle.entrypoints.openai.api_key import KEYED_PREFIXES, add_key_check
from treadle.entrypoints.openai.body_limit import BodySizeLimit
from treadle.entrypoints.openai.chat_page import add_chat_routes
from treadle.entrypoints.openai.cli_args import FrontendArgs
from treadle.entrypoints.openai.dashboard import add_dashboard_routes
from treadle.entrypoints.openai.errors import HANDLED, APIError, error_for
from treadle.entrypoints.openai.health import Health, add_health_routes
from treadle.entrypoints.openai.llamacpp import add_llamacpp_routes
from treadle.entrypoints.openai.lora_routes import add_lora_routes
from treadle.entrypoints.openai.openapi_responses import (
    GENERATED,
    INVOCATIONS_BODY,
    describe_errors,
    errors,
)
from treadle.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    fill_limits,
)
from treadle.entrypoints.openai.scale_routes import add_scale_routes
from treadle.entrypoints.openai.serving import OpenAIServing
from treadle.entrypoints.openai.serving_embeddings import EmbeddingRequest
from treadle.entrypoints.openai.starting import EngineStart, StartingServer, say_listening
from treadle.frontend.async_llm import AsyncLLM
from treadle.frontend.core_client import AttachTo
from treadle.frontend.metrics import render_metrics
from treadle.frontend.startup import StartupProgress, follow_phases, startup_address
from treadle.ipc.memory import malloc_trim, memory_line
from treadle.ipc.process import ReadyPipe, freeze_startup_heap
from treadle.logger import init_logger

logger = init_logger(__name__)


def settle_heap(engine: AsyncLLM) -> None:
    """Once this API server serves: its start-up heap frozen and trimmed, then one line with
    its idle memory beside each engine core's that it started (issue 41 item 2)."""
    freeze_startup_heap()
    launcher = getattr(engine.client, "launcher", None)
    pids = [child.pid or 0 for child in launcher.engines] if launcher is not None else []
    logger.info("%s", memory_line("API server", pids))


def build_app(
    engine: AsyncLLM,
    model_name: str,
    model_path: str,
    server: FrontendArgs | None = None,
    announce: str | None = None,
    own_process: bool = False,
    base_url: str | None = None,
) -> FastAPI:
    """The HTTP app. `model_path` (resolved) is only logged; clients see the served names.
    `own_process`: this is treadle's API server process (`run_server`), whose start-up heap
    is frozen once it serves (`freeze_startup_heap`). `base_url`: where it serves, said in
    the "Ready" line once it does (API server 0 says it)."""
    server = server or FrontendArgs()
    api_key = server.api_key
    serving = OpenAIServing(engine, model_name)
    if own_process:  # the tokenizer's load left ~30 MiB of freed heap: back to the OS now
        malloc_trim()
    inputs = serving.inputs

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if own_process:  # once serving (off the start-up's path)
            asyncio.get_running_loop().call_soon(settle_heap, engine)
        logger.info("Serving %s as %r", model_path, model_name)
        if announce:  # uvicorn says where it listens only when it opened the socket itself
            say_listening(announce)
        if base_url:
            logger.info("%s", ready_line(base_url))
        yield
        inputs.shutdown()

    docs: dict[str, Any] = {}
    if server.disable_fastapi_docs:
        docs = {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(
        title="treadle",
        version=treadle.__version__,
        lifespan=lifespan,
        responses=errors(413, 500),  # any request may carry a body; any route may fail
        **docs,
    )
    # As vLLM sets it (the constructor's parameter is deprecated): requests come with or
    # without the prefix, and the docs and the OpenAPI servers list carry it.
    app.root_path = server.root_path
    generate_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """The schema with this server's bounds (model name, vocabulary, lengths)."""
        if app.openapi_schema is None:
            limits = engine.input_processor.limits
            schema = generate_openapi()
            fill_limits(
                schema,
                serving.model_names,
                limits.vocab_size,
                limits.max_model_len,
                limits.max_logprobs,
            )
            describe_errors(schema, KEYED_PREFIXES if api_key else ())
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(BodySizeLimit, max_bytes=engine.config.frontend.max_request_body_bytes)
    if server.allowed_origins:  # vLLM allows any origin by default; treadle none unless told
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(server.allowed_origins),
            allow_credentials=server.allow_credentials,
            allow_methods=list(server.allowed_methods),
            allow_headers=list(server.allowed_headers),
        )

    async def openai_error(_: Request, e: Exception) -> JSONResponse:
        status, body = error_for(e)  # the same map the streams' error events use
        return JSONResponse(body, status_code=status)

    for handled in HANDLED:
        app.add_exception_handler(handled, openai_error)

    if api_key:
        add_key_check(app, api_key, server.root_path)

    add_health_routes(app, Health(engine.progress, engine))

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": treadle.__version__}

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"description": "Prometheus' text format", "content": {"text/plain": {}}}},
    )
    async def metrics() -> Response:
        return Response(render_metrics(), media_type=CONTENT_TYPE_LATEST)

    add_dashboard_routes(app, engine)
    add_chat_routes(app)
    add_llamacpp_routes(app, serving)
    add_scale_routes(app, engine)
    add_lora_routes(app, serving, several=server.api_servers(engine.config) > 1)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=serving.model_cards())

    @app.get("/v1/models/{model_id:path}", responses=errors(404))
    async def model(model_id: str) -> ModelCard:
        return serving.model_card(model_id)

    @app.post("/v1/completions", responses=GENERATED)
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions", responses=GENERATED)
    async def chat(req: ChatCompletionRequest, raw: Request) -> Any:
        return await serving.chat(req, raw)

    @app.post("/v1/embeddings", responses=errors(400, 404, 500, 503))
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Any:
        return await serving.embeddings(req, raw)

    @app.post("/invocations", responses=GENERATED, openapi_extra=INVOCATIONS_BODY)
    async def invocations(raw: Request) -> Any:
        """SageMaker's route, as vLLM serves it: a body with `messages` is a chat completion,
        one with `prompt` a completion."""
        try:
            body = await raw.json()
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(f"JSON decode error: {e}", 400, "BadRequestError") from e
        kind = next((k for k in ("messages", "prompt") if isinstance(body, dict) and k in body), "")
        if not kind:
            raise APIError(
                "Cannot find suitable handler for request. Expected one of: "
                "['ChatCompletionRequest', 'CompletionRequest']",
                400,
                "BadRequestError",
            )
        try:
            if kind == "messages":
                return await serving.chat(ChatCompletionRequest.model_validate(body), raw)
            return await serving.completions(CompletionRequest.model_validate(body), raw)
        except ValidationError as e:  # as FastAPI's own check of a route's body reports it
            raise RequestValidationError(e.errors()) from e

    @app.post("/tokenize", responses=errors(400, 404))
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(req.model)
        ids = await inputs.tokenize(
            req.prompt, req.messages, req.add_special_tokens, req.add_generation_prompt
        )
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", responses=errors(400, 404))
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        serving.check_model(req.model)
        return {"prompt": await inputs.detokenize(req.tokens)}

    return app


def ready_line(base_url: str) -> str:
    """The line that says the server serves now, and where."""
    return (
        f"Ready: the OpenAI API at {base_url}/v1, the chat page at {base_url}/, "
        f"the dashboard at {base_url}/dashboard"
    )


def run_server(
    engine: AsyncLLM | EngineStart,
    model_name: str,
    model_path: str,
    server: FrontendArgs,
    port: int,
    sock: socket.socket | None = None,
    shared: bool = False,
    client_index: int = 0,
) -> int:
    """Serve until SIGTERM/SIGINT (exit 0) or engine death (exit 1); returns the exit code.
    `engine`: the engine client, built; or how to build it, while HTTP already serves
    (`starting.py`: a start-up that fails exits 1, saying why). `sock`: the HTTP socket,
    already bound (by the CLI, or by the supervisor for several API servers, which `shared`
    says); `port`: the one it is bound to. API server 0 says where it listens."""
    announce = None
    built = engine if isinstance(engine, AsyncLLM) else None
    base_url = None
    if client_index == 0:
        base_url = f"{server.scheme}://{server.host}:{port}{server.root_path}"
    if sock is not None and client_index == 0:
        note = " (shared by every API server)" if shared else ""
        announce = f"Uvicorn running on {server.scheme}://{server.host}:{port}{note}"
    engine_died = False

    def on_dead(reason: str) -> None:
        nonlocal engine_died
        engine_died = True
        # Give failing streams a moment to send their error, then stop serving.
        asyncio.get_running_loop().call_later(2.0, setattr, http_server, "should_exit", True)

    app: Any
    starting = None
    if built is not None:
        built.when_dead(on_dead)
        app = build_app(built, model_name, model_path, server, announce, True, base_url)
    else:
        assert isinstance(engine, EngineStart)
        app = starting = StartingServer(
            engine,
            lambda e: build_app(e, model_name, model_path, server, None, True, base_url),
            server,
            announce,
            stop_serving=lambda: setattr(http_server, "should_exit", True),
            on_engine=lambda e: e.when_dead(on_dead),
        )
    config = uvicorn.Config(
        app,
        host=server.host,
        port=port,
        log_level=server.uvicorn_log_level,
        access_log=not server.disable_uvicorn_access_log,
        ssl_keyfile=server.ssl_keyfile,
        ssl_certfile=server.ssl_certfile,
        ssl_ca_certs=server.ssl_ca_certs,
        loop="uvloop",
        http="httptools",
        # Streams end when the engine has drained (--shutdown-timeout), not before.
        timeout_graceful_shutdown=5 + int(server.shutdown_timeout),
    )
    http_server = uvicorn.Server(config)
    # uvicorn handles SIGTERM/SIGINT while it serves and raises them again when it is done;
    # by then they have been handled, so let them pass and shut the engine down below.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        http_server.run(sockets=[sock] if sock is not None else None)
    finally:
        if starting is not None:
            built = starting.join()
        if built is not None:
            built.shutdown()
    if starting is not None and starting.failure is not None:
        print(f"treadle serve: error: {starting.failure}", file=sys.stderr)
        return 1
    if engine_died:
        logger.error("Exiting because the engine core died")
        return 1
    return 0


def run_api_server_worker(
    ready: ReadyPipe,
    sock: socket.socket,
    config: EngineConfig,
    model_name: str,
    model_path: str,
    client_index: int,
    coordinator: str | None,
    server: FrontendArgs,
    reuse: list[str] | None = None,
    supervisor: str | None = None,
) -> None:
    """Process entry of API server `client_index` of several (`--api-server-count`).

    Binds its own ROUTER/PULL pair, hands their addresses and its engine key to the supervisor
    through the ready pipe (the supervisor runs the engines' handshake), waits for every engine, then serves
    HTTP on the shared socket `sock`. `reuse`: the report of the dead API server this one
    replaces (`AttachTo.reuse`)."""

    def leave(signum: int, frame: Any) -> None:  # until uvicorn handles signals itself
        raise SystemExit(128 + signum)  # unwinds: sockets close, ipc files go

    signal.signal(signal.SIGTERM, leave)
    attach = AttachTo(ready.send_ready, coordinator, reuse, supervisor)
    engine: AsyncLLM | EngineStart
    if reuse is None:
        # The first start: serve HTTP while the supervisor's engines start, with their phases
        # (`/health/startup`, `/topology`), as a single API server does.
        progress = StartupProgress(config.parallel.data_parallel_size, supervisor is not None)
        if supervisor is not None:
            follow_phases(progress, startup_address(supervisor))
        engine = EngineStart(
            lambda: AsyncLLM(
                config, model_name, server.shutdown_timeout, client_index, attach, progress
            ),
            progress,
        )
    else:
        # A replacement attaches to running engines (quick) and takes no connection before:
        # meanwhile the other API servers answer them all.
        engine = AsyncLLM(config, model_name, server.shutdown_timeout, client_index, attach)
    port = sock.getsockname()[1]
    code = run_server(engine, model_name, model_path, server, port, sock, True, client_index)
    raise SystemExit(code)
