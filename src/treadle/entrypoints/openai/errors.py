"""Exceptions to HTTP errors: one map, used by the API server's exception handlers and by the
streams' error events alike, so a failure reads the same however the client asked.

Every error is OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the
HTTP status as `code`:

| exception                         | status | type                  | message                  |
|-----------------------------------|--------|-----------------------|--------------------------|
| `APIError`                        | its own| its own               | its own                  |
| `InvalidRequest`                  | 400    | BadRequestError       | `message` (`param` set)  |
| `RequestValidationError` (FastAPI)| 400    | BadRequestError       | the first error, where   |
| `HTTPException` (Starlette)       | its own| NotFoundError, ...    | its detail               |
| `EngineDeadError`                 | 503    | EngineDeadError       | "The engine is dead: …"  |
| `RequestKilledEngineError`        | 500    | InternalServerError   | the error's text         |
| anything else (a bug)             | 500    | InternalServerError   | "internal error: <type>" |

A client's fault is an `InvalidRequest` (or an `APIError`); any other `ValueError` is a bug
(a 500, as "X-data-parallel-rank: ²" was before `parse_int`), not something to blame on the
client. A bug's message names only its type; the traceback goes to the log (`is_bug` says
which errors those are).
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from treadle.frontend.core_client import EngineDeadError, RequestKilledEngineError
from treadle.validation import InvalidRequest


class APIError(Exception):
    """An error with an HTTP status, rendered in OpenAI's JSON error shape."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        kind: str = "BadRequestError",
        param: str | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param


HANDLED: tuple[type[Exception], ...] = (
    APIError,
    InvalidRequest,
    RequestValidationError,
    HTTPException,
    EngineDeadError,
    RequestKilledEngineError,
    Exception,
)
"""The exception types to register `error_for`'s handler for (Starlette picks a handler by
the exception's class, so FastAPI's own defaults for its two must be replaced by name)."""

_HTTP_KINDS = {404: "NotFoundError", 413: "RequestTooLargeError"}


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def as_api_error(e: BaseException) -> APIError:
    """What the client is told about `e` (the table in the module docstring)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequest):
        return APIError(e.message, 400, "BadRequestError", e.param)
    if isinstance(e, RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{first.get('msg', 'invalid request')}" + (f" (at {where})" if where else "")
        return APIError(message, 400, "BadRequestError", where or None)
    if isinstance(e, HTTPException):
        kind = _HTTP_KINDS.get(e.status_code, "HTTPError")
        return APIError(str(e.detail), e.status_code, kind)
    if isinstance(e, EngineDeadError):
        return APIError(f"The engine is dead: {e}", 503, "EngineDeadError")
    if isinstance(e, RequestKilledEngineError):
        return APIError(str(e), 500, "InternalServerError")
    return APIError(f"internal error: {type(e).__name__}", 500, "InternalServerError")


def is_bug(e: BaseException) -> bool:
    """Whether `e` is none of the known errors: a bug, whose traceback belongs in the log."""
    return not isinstance(e, HANDLED[:-1])


def error_for(e: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body for `e`."""
    error = as_api_error(e)
    return error.status, error_body(error.message, error.status, error.kind, error.param)
