"""A limit on the size of HTTP request bodies (`--max-request-body-bytes`), answered with 413
in OpenAI's error shape without holding the body in memory.

A client sends its whole body before it reads the answer (httpx, the openai client), and a
server that closes a connection with unread bytes resets it, which can take the answer with
it: the client then sees a connection error (and the openai client retries). So the rest of
an over-size body is read and dropped, up to DRAIN_FACTOR times the limit, before the 413
goes out; the connection then serves on. A body past that bound (or declared past it) gets
its 413 at once with `Connection: close`: reading it all would cost more than the answer is
worth."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from treadle.validation import InvalidRequest, parse_int

DRAIN_FACTOR = 4
"""An over-size body is read (and dropped) up to this many times the limit."""


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413, f"The request body is larger than {limit} bytes (--max-request-body-bytes)"
        )


def declared_length(scope: Scope) -> int | None:
    """The request's `Content-Length` when it is a number (`parse_int`: ASCII digits), else
    None."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return parse_int(value.decode("latin-1"), "Content-Length", 0)
            except InvalidRequest:
                return None
    return None


async def drain(receive: Receive, received: int, bound: int) -> bool:
    """Read and drop the rest of a request body; True when it ended with at most `bound`
    bytes in all (`received` of them read already), False when it went past the bound or the
    client left."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return False
        received += len(message.get("body", b""))
        if received > bound:
            return False
        if not message.get("more_body", False):
            return True


class BodySizeLimit:
    """ASGI middleware. A declared `Content-Length` over the limit is answered here, after the
    body is drained; a body that grows past the limit while the app reads it is drained, then
    `receive` raises `BodyTooLarge` (an `HTTPException`, which FastAPI passes on to the app's
    handler). Either way the answer says `Connection: close` when draining stopped at the
    bound."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bound = DRAIN_FACTOR * max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            # A client that waits for "100 Continue" before it sends the body (curl does,
            # over 1 MB) gets the 413 instead, and sends nothing: there is nothing to drain.
            waits = any(
                k == b"expect" and v.lower() == b"100-continue" for k, v in scope["headers"]
            )
            drained = (
                not waits
                and declared <= self.drain_bound
                and await drain(receive, 0, self.drain_bound)
            )
            await self._refuse(send, close=not drained)
            return
        received = 0
        close = False

        async def limited_receive() -> Message:
            nonlocal received, close
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    more = message.get("more_body", False)
                    close = more and not await drain(receive, received, self.drain_bound)
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def closing_send(message: Message) -> None:
            if close and message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, limited_receive, closing_send)

    async def _refuse(self, send: Send, close: bool) -> None:
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
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
