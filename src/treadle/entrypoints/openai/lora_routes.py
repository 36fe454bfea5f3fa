"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's, with
TREADLE_ALLOW_RUNTIME_LORA_UPDATING=1 or vLLM's variable): adapters loaded and unloaded while
serving (`frontend/loras.py` says what is checked); and llama.cpp's `GET /lora-adapters`
(`[{"id", "path", "scale"}]`) and `POST /lora-adapters` (`[{"id", "scale"}]`: the adapter its
/completion and /infill apply to requests that name none)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from treadle.entrypoints.openai.errors import APIError
from treadle.entrypoints.openai.openapi_responses import errors
from treadle.entrypoints.openai.serving_base import ServingBase
from treadle.validation import InvalidRequest

KEYED_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # (under /v1: keyed)
# (not response_class=PlainTextResponse: the schema would say errors are text too)
ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {"description": "Success: ... (text, as vLLM's)", "content": {"text/plain": {}}},
    **errors(400),
}


async def _body(raw: Request, fields: set[str]) -> dict[str, Any]:
    try:
        body = await raw.json()
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"JSON decode error: {e}", 400, "BadRequestError") from e
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise InvalidRequest(unknown[0], "is not a field of this endpoint")
    return body


def add_lora_routes(app: FastAPI, serving: ServingBase, several: bool = False) -> None:
    """`several`: this is one of several API servers on one port, where a load would reach
    only the one that took the connection: refused, with the way out."""
    loras = serving.loras

    def check_one_server() -> None:
        if several:
            raise InvalidRequest(
                "lora_name",
                "loading adapters while serving needs one API server (--api-server-count 1): "
                "with several, a load would reach only the one that took this connection; "
                "give the adapters with --lora-modules instead",
            )

    @app.get("/lora-adapters")
    async def list_lora_adapters() -> list[dict[str, Any]]:
        return loras.llamacpp_list()

    @app.post("/lora-adapters", responses=errors(400))
    async def set_lora_adapters(raw: Request) -> list[dict[str, Any]]:
        if several:
            raise InvalidRequest(
                "body",
                "setting adapters' scales needs one API server (--api-server-count 1): with "
                "several, it would reach only the one that took this connection",
            )
        try:
            body = await raw.json()
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(f"JSON decode error: {e}", 400, "BadRequestError") from e
        loras.llamacpp_set(body)
        return loras.llamacpp_list()

    @app.post("/v1/load_lora_adapter", response_class=Response, responses=ANSWERS)
    async def load_lora_adapter(raw: Request) -> Response:
        check_one_server()
        body = await _body(raw, {"lora_name", "lora_path", "load_inplace"})
        if body.get("load_inplace"):
            raise InvalidRequest("load_inplace", "is not supported: unload the adapter first")
        name = body.get("lora_name")
        await loras.load(name, body.get("lora_path"), serving.on_every_engine)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=Response, responses=ANSWERS)
    async def unload_lora_adapter(raw: Request) -> Response:
        check_one_server()
        body = await _body(raw, {"lora_name", "lora_int_id"})
        name = body.get("lora_name")
        await loras.unload(name, serving.on_every_engine)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
