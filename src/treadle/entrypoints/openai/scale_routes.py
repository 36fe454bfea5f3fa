"""`POST /scale {"data_parallel_size": N}`: more or fewer engines while serving
(`frontend/engine_scale.py` does it), and vLLM's spelling of the same,
`POST /scale_elastic_ep {"new_data_parallel_size": N, "drain_timeout": S}` with
`GET`/`POST /is_scaling_elastic_ep`. `--api-key` guards them (`KEYED_PATHS`)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request

from treadle.entrypoints.openai.errors import APIError
from treadle.entrypoints.openai.openapi_responses import errors
from treadle.frontend.async_llm import AsyncLLM
from treadle.frontend.engine_scale import ScaleRefused
from treadle.logger import init_logger

logger = init_logger(__name__)

KEYED_PATHS = ("/scale", "/is_scaling_elastic_ep")
"""What `--api-key` guards here (a prefix: `/scale_elastic_ep` too)."""

DEFAULT_DRAIN_TIMEOUT_S = 120  # as vLLM's


def add_scale_routes(app: FastAPI, engine: AsyncLLM) -> None:
    async def scale(raw: Request, size_field: str) -> dict[str, Any]:
        body = await _json_object(raw)
        unknown = sorted(set(body) - {size_field, "drain_timeout"})
        if unknown:
            raise APIError(
                f"unknown field(s) {unknown}: this route takes {size_field!r} and 'drain_timeout'",
                param=unknown[0],
            )
        if size_field not in body:
            raise APIError(
                f'{size_field} is required: {{"{size_field}": N}}, the number of engines',
                param=size_field,
            )
        n = body[size_field]
        drain = body.get("drain_timeout", DEFAULT_DRAIN_TIMEOUT_S)
        if isinstance(drain, bool) or not isinstance(drain, int | float) or not drain > 0:
            raise APIError(
                f"drain_timeout must be a positive number of seconds, not {drain!r}",
                param="drain_timeout",
            )
        try:
            old = await engine.scale(n, float(drain))
        except ScaleRefused as e:
            status, kind = (409, "ConflictError") if e.busy else (400, "BadRequestError")
            message = str(e).replace("data_parallel_size", size_field, 1)
            raise APIError(message, status, kind, size_field) from None
        except (RuntimeError, TimeoutError) as e:  # a new engine did not start (logged)
            raise APIError(f"scaling to {n} failed: {e}", 500, "InternalServerError") from None
        return {
            "message": f"Scaled from {old} to {n} data parallel engines",
            "old_data_parallel_size": old,
            "new_data_parallel_size": n,
        }

    @app.post("/scale", responses=errors(400, 409))
    async def scale_route(raw: Request) -> dict[str, Any]:
        """Run `data_parallel_size` engines: new ones start and join; the highest ranks are
        drained (at most `drain_timeout` s, then their requests resume on the others) and
        stop."""
        return await scale(raw, "data_parallel_size")

    @app.post("/scale_elastic_ep", responses=errors(400, 409))
    async def scale_elastic_ep(raw: Request) -> dict[str, Any]:
        """vLLM's name for `/scale`."""
        return await scale(raw, "new_data_parallel_size")

    @app.api_route("/is_scaling_elastic_ep", methods=["GET", "POST"])
    async def is_scaling() -> dict[str, bool]:
        return {"is_scaling_elastic_ep": engine.client.scaler.scaling}


async def _json_object(raw: Request) -> dict[str, Any]:
    try:
        body = json.loads(await raw.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError('the body must be a JSON object, e.g. {"data_parallel_size": 3}')
    return body
