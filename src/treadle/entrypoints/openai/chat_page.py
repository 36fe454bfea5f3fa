"""`GET /` and `GET /chat`: a self-contained chat page in the browser (llama.cpp serves its web
UI at `/`; treadle serves the same page at both, with a link to the dashboard).

The page (`chat.html`, package data: no CDN, no build step) needs no key; what it calls does
(`/v1/models`, `/v1/chat/completions`) when `--api-key` is set: it asks for the key on a 401
and keeps it in the browser's local storage, as the dashboard does (the same item, so one key
serves both pages). It calls the API with URLs relative to its own path, so it works behind
`--root-path` and a proxy. Model output is escaped before its markdown is drawn: the page
never turns model text into HTML elements other than its own few (code, emphasis, lists,
headings, http(s) links).
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

PATHS = ("/", "/chat")


def chat_page() -> str:
    return resources.files(__package__).joinpath("chat.html").read_text(encoding="utf-8")


def add_chat_routes(app: FastAPI) -> None:
    page = chat_page()

    async def chat() -> HTMLResponse:
        """The chat page: streamed answers, stop, a system prompt, temperature and max tokens,
        the conversation kept in the browser."""
        return HTMLResponse(page)

    for path in PATHS:  # (not response_class=HTMLResponse: the schema would say errors are HTML)
        app.get(
            path,
            response_class=Response,
            responses={200: {"description": "The page", "content": {"text/html": {}}}},
        )(chat)
