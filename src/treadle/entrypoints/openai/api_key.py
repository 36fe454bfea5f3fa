"""`--api-key`: the middleware that asks for `Authorization: Bearer <key>` on the keyed paths
(as vLLM: /v1 and /invocations; here also the dashboard's data and llama.cpp's routes)."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from treadle.entrypoints.openai.dashboard import KEYED_PATHS
from treadle.entrypoints.openai.errors import error_body
from treadle.entrypoints.openai.llamacpp import KEYED_PATHS as LLAMACPP_PATHS
from treadle.entrypoints.openai.scale_routes import KEYED_PATHS as SCALE_PATHS

KEYED_PREFIXES = ("/v1", "/invocations", *KEYED_PATHS, *LLAMACPP_PATHS, *SCALE_PATHS)
"""What `--api-key` guards."""


def add_key_check(app: FastAPI, api_key: str, root_path: str) -> None:
    expected = f"Bearer {api_key}".encode()
    root = root_path.rstrip("/")

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Response:
        given = request.headers.get("Authorization", "").encode()
        path = request.scope["path"]
        if root and (path == root or path.startswith(root + "/")):  # as routing does
            path = path[len(root) :]
        keyed = path.startswith(KEYED_PREFIXES)
        # Constant time: how long a wrong key takes must not tell how much of it was right.
        if keyed and not hmac.compare_digest(given, expected):
            return JSONResponse(
                error_body("Unauthorized: missing or wrong API key", 401, "AuthenticationError"),
                status_code=401,
            )
        response: Response = await call_next(request)
        return response
