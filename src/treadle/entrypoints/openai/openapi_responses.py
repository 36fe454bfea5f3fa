"""What the OpenAPI schema says about the API server's answers beyond what FastAPI infers: the
error body on every route, the probes' empty 200, the streams, the body of `/invocations`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

INVOCATIONS_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "anyOf": [
                        {"$ref": "#/components/schemas/ChatCompletionRequest"},
                        {"$ref": "#/components/schemas/CompletionRequest"},
                    ]
                }
            }
        },
    }
}
"""`/invocations` reads its body itself (which request it is depends on its fields): the
schema says what it takes."""


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every error answer, in OpenAI's shape (`serving.error_body`)."""

    error: ErrorInfo


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of a route's error answers."""
    return {code: {"model": ErrorResponse} for code in codes}


NO_CONTENT: dict[str, Any] = {"description": "Yes (no content)", "content": {}}
"""A probe's 200: no body, no content type (as vLLM answers it)."""
GENERATED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The answer; with `stream: true`, server-sent events ending in "
        "`data: [DONE]`",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **errors(400, 404, 503),
}
"""The responses of the routes that generate (besides every route's, `build_app`)."""


def describe_errors(schema: dict[str, Any], keyed: tuple[str, ...]) -> None:
    """What FastAPI's schema would say wrong: a bad body is a 400 here, never a 422 (see
    `validation_error`); the routes an API key guards also answer 401."""
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.get("responses", {})
            responses.pop("422", None)
            if path.startswith(keyed):
                responses["401"] = {
                    "description": "Missing or wrong API key",
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/ErrorResponse"}
                        }
                    },
                }
    for unused in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(unused, None)
