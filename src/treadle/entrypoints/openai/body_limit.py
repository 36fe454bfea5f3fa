"""A limit on the size of HTTP request bodies (`--max-request-body-bytes`), answered with 413
in OpenAI's error shape before the body is read into memory."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413, f"The request body is larger than {limit} bytes (--max-request-body-bytes)"
        )


class BodySizeLimit:
    """ASGI middleware. A declared `Content-Length` over the limit is answered at once; a body
    that grows past it while being read raises `BodyTooLarge` (an `HTTPException`, which
    FastAPI passes on to the app's handler) from `receive`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._refuse(send)
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)

    async def _refuse(self, send: Send) -> None:
        error = BodyTooLarge(self.max_bytes)
        body = json.dumps(
            {
                "error": {
                    "message": error.detail,
                    "type": "RequestTooLargeError",
                    "param": None,
                    "code": 413,
                }
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
