"""Requests that used to kill, wedge or confuse `treadle serve` (issue 12): each gets a 4xx in
OpenAI's error shape naming the field, `/health` stays prompt while huge inputs are refused
or tokenized, and the server keeps giving the same greedy text throughout."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from serve_helpers import RemoteServer

CHAT = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory) -> Iterator[RemoteServer]:  # type: ignore[no-untyped-def]
    model = str(tiny_model_factory("llama"))
    srv = RemoteServer([model, "--max-model-len", "128"], tmp_path_factory.mktemp("bad-requests"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def greedy_text(server: RemoteServer) -> str:
    """The server's greedy answer before any bad request reached it."""
    resp = httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=30)
    assert resp.status_code == 200, resp.text
    text: str = resp.json()["choices"][0]["text"]
    assert text
    return text


def _assert_error(resp: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if status == 400:
        assert error["type"] == "BadRequestError"
    assert error["param"] == param, error
    return error


BIG = 2**64
CMPL = "/v1/completions"
CHATS = "/v1/chat/completions"
BAD: list[tuple[str, dict[str, Any] | str, str | None]] = [
    # the four crashes of the issue
    (CMPL, {"prompt": "hi", "logprobs": 100_000}, "logprobs"),
    (CHATS, {"messages": CHAT, "logprobs": True, "top_logprobs": 100_000}, "top_logprobs"),
    (CMPL, {"prompt": "hi", "top_k": 2**63}, "top_k"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [1_000_000], "min_tokens": 2}, "stop_token_ids"),
    # 500s with plain-text bodies
    (CMPL, {"prompt": "hi", "top_k": BIG}, "top_k"),
    (CMPL, {"prompt": "hi", "seed": BIG}, "seed"),
    (CMPL, {"prompt": "hi", "priority": BIG}, "priority"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [BIG]}, "stop_token_ids"),
    (CMPL, '{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (CMPL, '{"prompt": "hi", "temperature": NaN}', "temperature"),
    (CMPL, '{"prompt": "hi", "top_p": -Infinity}', "top_p"),
    (CMPL, {"prompt": "hi", "max_tokens": 2**63}, "max_tokens"),
    (CMPL, {"prompt": "hi", "n": 0}, "n"),
    (CMPL, {"prompt": "hi", "n": 10**6}, "n"),
    (CMPL, {"prompt": [[]]}, "prompt"),
    (CMPL, {"prompt": [10**9]}, "prompt"),
    (CMPL, {"prompt": [BIG]}, "prompt"),
    (CMPL, {"prompt": [-1]}, "prompt"),
    (CMPL, {"prompt": ["a"] * 3000}, "prompt"),
    (CMPL, {"prompt": ["a"] * 100, "n": 100}, "n"),
    (CMPL, {"prompt": "hi", "stop": ["x"] * 2000}, "stop"),
    (CHATS, {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    (CHATS, {"messages": CHAT, "max_completion_tokens": 10**6}, "max_completion_tokens"),
    (CHATS, {"messages": CHAT, "chat_template": "{{ 7 * 7 }}"}, "chat_template"),
    (CHATS, {"messages": CHAT, "chat_template_kwargs": {"chat_template": "x"}}, "chat_template"),
    (CHATS, {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    (CHATS, {"messages": []}, "messages"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [BIG]}, "tokens"),
    # issue 13: the fields of OpenAI and vLLM, and those refused rather than ignored
    (CMPL, {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"1": 101}}, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"1000000": 1}}, "logit_bias"),
    (CMPL, {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    (CMPL, {"prompt": "hi", "allowed_token_ids": [10**9]}, "allowed_token_ids"),
    (CMPL, {"prompt": "hi", "bad_words": [" "]}, "bad_words"),
    (CMPL, {"prompt": "hi", "structured_outputs": {}}, "structured_outputs"),
    (
        CMPL,
        {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        "structured_outputs",
    ),
    (CMPL, {"prompt": "hi", "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    (
        CMPL,
        {"prompt": "hi", "response_format": {"type": "json_object"}, "guided_regex": "a"},
        "response_format",
    ),
    (CHATS, {"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    (
        CHATS,
        {
            "messages": CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
        "response_format",
    ),
    (CHATS, {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    (
        CHATS,
        {"messages": CHAT, "guided_json": {"type": "object"}, "guided_regex": "a"},
        "guided_json",
    ),
    (CMPL, {"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (CMPL, {"prompt": "hi", "truncate_prompt_tokens": 128}, "truncate_prompt_tokens"),
    (CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (CMPL, {"prompt": "hi", "best_of": 2}, "best_of"),
    (CMPL, {"prompt": "hi", "suffix": "x"}, "suffix"),
    (CHATS, {"messages": CHAT, "use_beam_search": True}, "use_beam_search"),
    (CMPL, {"prompt": "hi", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    (CMPL, {"prompt": "hi", "logits_processors": ["m.f"]}, "logits_processors"),
    (CHATS, {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    (CHATS, {"messages": CHAT, "function_call": "auto"}, "function_call"),
    (CHATS, {"messages": CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHATS, {"messages": CHAT, "modalities": ["text", "audio"]}, "modalities"),
    (CHATS, {"messages": CHAT, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    (CHATS, {"messages": CHAT, "web_search_options": {}}, "web_search_options"),
    (CHATS, {"messages": CHAT, "echo": True}, "echo"),
    (CHATS, {"messages": CHAT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p}:{q}" for p, _, q in BAD])
def test_a_bad_field_gets_a_400_naming_it_and_the_server_goes_on(
    server: RemoteServer, greedy_text: str, path: str, body: dict[str, Any] | str, param: str
) -> None:
    if isinstance(body, str):  # JSON that Python's json module would not write
        resp = httpx.post(
            server.url + path,
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
    else:
        resp = httpx.post(server.url + path, json=body, timeout=30)
    _assert_error(resp, 400, param)
    again = httpx.post(server.url + CMPL, json=GREEDY, timeout=30)
    assert again.json()["choices"][0]["text"] == greedy_text


def test_prompt_embeds_without_the_flag_are_a_400_naming_it(server: RemoteServer) -> None:
    body = {"prompt": "", "prompt_embeds": "AAAA"}
    error = _assert_error(
        httpx.post(server.url + CMPL, json=body, timeout=30), 400, "prompt_embeds"
    )
    assert "--enable-prompt-embeds" in error["message"]


def test_a_bad_field_in_a_stream_is_a_400_before_the_stream(server: RemoteServer) -> None:
    body = {"prompt": "hi", "stream": True, "logprobs": 100_000}
    _assert_error(httpx.post(server.url + CMPL, json=body, timeout=30), 400, "logprobs")


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
        {"type": "video_url", "video_url": {"url": "http://example.com/cat.mp4"}},
    ],
    ids=lambda part: part["type"],
)
def test_content_other_than_text_is_refused_not_ignored(
    server: RemoteServer, part: dict[str, Any]
) -> None:
    content = [{"type": "text", "text": "What is this?"}, part]
    body = {"messages": [{"role": "user", "content": content}]}
    error = _assert_error(httpx.post(server.url + CHATS, json=body, timeout=30), 400, "messages")
    assert "text only" in error["message"] and part["type"] in error["message"]


def test_text_content_parts_are_joined(server: RemoteServer) -> None:
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colors."}]
    as_parts = {"messages": [{"role": "user", "content": parts}], "max_tokens": 4}
    as_text = {"messages": [{"role": "user", "content": "Name three\ncolors."}], "max_tokens": 4}
    a = httpx.post(server.url + CHATS, json={**as_parts, "temperature": 0}, timeout=30).json()
    b = httpx.post(server.url + CHATS, json={**as_text, "temperature": 0}, timeout=30).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"] == b["usage"]


def test_models_shows_no_filesystem_path(server: RemoteServer) -> None:
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["root"] == card["id"] and "/" not in json.dumps(card)


def _health_latencies_during(server: RemoteServer, send: Any) -> tuple[Any, list[float]]:
    """Run `send()` in a thread; meanwhile time `/health` again and again."""
    latencies: list[float] = []
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as client:
        future = pool.submit(send)
        while not future.done():
            start = time.monotonic()
            assert client.get(server.url + "/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
        return future.result(), latencies


def test_huge_prompts_are_refused_before_tokenizing_and_health_stays_prompt(
    server: RemoteServer, greedy_text: str
) -> None:
    """A 10 MB prompt is over the 8 MiB body limit (413, the body is never parsed); a 5 MB one
    is parsed but refused by its length in characters (400), without tokenizing it (that
    took 23 s on the event loop)."""
    for size, status in ((10_000_000, 413), (5_000_000, 400)):
        prompt = "hello world " * (size // 12)
        start = time.monotonic()
        resp, latencies = _health_latencies_during(
            server, lambda p=prompt: httpx.post(server.url + CMPL, json={"prompt": p}, timeout=60)
        )
        error = _assert_error(resp, status, None if status == 413 else "prompt")
        assert ("--max-request-body-bytes" if status == 413 else "--max-prompt-chars") in error[
            "message"
        ]
        assert time.monotonic() - start < 10
        assert max(latencies, default=0.0) < 1.0, latencies
    chat = {"messages": [{"role": "user", "content": prompt}]}
    _assert_error(httpx.post(server.url + CHATS, json=chat, timeout=60), 400, "messages")
    _assert_error(httpx.post(server.url + "/tokenize", json={"prompt": prompt}), 400, "prompt")
    again = httpx.post(server.url + CMPL, json=GREEDY, timeout=30)
    assert again.json()["choices"][0]["text"] == greedy_text


def test_limits_flags_and_a_trusted_request_chat_template(
    server_factory, tiny_model_factory
) -> None:  # type: ignore[no-untyped-def]
    """Raised prompt limit: a 2.5 MB prompt is tokenized, off the event loop, then refused as
    too many tokens; a smaller body limit; a request's own chat template when trusted."""
    srv = server_factory(
        [
            str(tiny_model_factory("llama")),
            "--max-model-len",
            "128",
            "--max-prompt-chars",
            "3000000",
            "--max-request-body-bytes",
            "3MiB",
            "--trust-request-chat-template",
        ]
    )
    prompt = "hello world " * 210_000  # 2.5 MB, about 420,000 tokens
    resp, latencies = _health_latencies_during(
        srv, lambda: httpx.post(srv.url + CMPL, json={"prompt": prompt}, timeout=120)
    )
    error = _assert_error(resp, 400, "prompt")
    assert "tokens" in error["message"] and "maximum context length is 128" in error["message"]
    assert len(latencies) >= 3, "tokenizing was expected to take a while"
    assert max(latencies) < 1.0, latencies

    too_big = {"prompt": "x" * (4 << 20)}
    _assert_error(httpx.post(srv.url + CMPL, json=too_big, timeout=60), 413, None)

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    body = {"messages": CHAT, "chat_template": template, "max_tokens": 2, "temperature": 0}
    resp = httpx.post(srv.url + CHATS, json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    tokens = httpx.post(
        srv.url + "/tokenize", json={"prompt": CHAT[0]["content"], "add_special_tokens": False}
    ).json()
    assert resp.json()["usage"]["prompt_tokens"] == tokens["count"]


TEN_MB = 10_000_000


def _raw_post(url: str, head: str, chunks: Iterable[bytes]) -> tuple[int, bytes, socket.socket]:
    """POST over a bare socket: send every chunk (an `OSError` fails the test: the server
    reset the connection while the body was coming), then read one answer. Returns the bytes
    sent, the answer and the socket, still open."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode())
    sent = 0
    for chunk in chunks:
        sock.sendall(chunk)
        sent += len(chunk)
    return sent, _read_answer(sock), sock


def _read_answer(sock: socket.socket) -> bytes:
    """One HTTP answer with a Content-Length (as the 413 has)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _assert_413(answer: bytes) -> str:
    """The answer is a 413 in OpenAI's error shape; returns its head."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), answer[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 413
    assert "--max-request-body-bytes" in error["message"]
    return head.decode().lower()


def test_an_over_size_body_is_read_to_its_end_before_its_413(
    server: RemoteServer, greedy_text: str
) -> None:
    """Issue 28: the server answered a 10 MB body at once and closed the connection while the
    client still sent: the client got a reset instead of the 413. It now drops the rest of
    the body (declared or chunked), answers, and the connection serves on."""
    piece = b"x" * 65536
    declared = f"Content-Type: application/json\r\nContent-Length: {TEN_MB}\r\n"
    body = (piece[: min(len(piece), TEN_MB - i)] for i in range(0, TEN_MB, len(piece)))
    start = time.monotonic()
    sent, answer, sock = _raw_post(server.url, declared, body)
    took = time.monotonic() - start
    with sock:
        assert sent == TEN_MB
        assert "connection: close" not in _assert_413(answer)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    assert took < 5, took

    chunked = (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(TEN_MB // len(piece)))
    head = "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    sent, answer, sock = _raw_post(server.url, head, (*chunked, b"0\r\n\r\n"))
    sock.close()
    assert "connection: close" not in _assert_413(answer)

    # Past the bound (4 times the limit) the 413 comes at once, and the connection closes;
    # so it does for a client that waits for "100 Continue" before it sends the body.
    for head in ("Content-Length: 40000000\r\n", f"{declared}Expect: 100-continue\r\n"):
        sent, answer, sock = _raw_post(server.url, head, iter(()))
        sock.close()
        assert "connection: close" in _assert_413(answer)
    again = httpx.post(server.url + CMPL, json=GREEDY, timeout=30)
    assert again.json()["choices"][0]["text"] == greedy_text


@pytest.mark.parametrize(
    "body", [json.dumps({"prompt": "x" * TEN_MB}).encode(), b"\xff\x00 garbage" * (TEN_MB // 10)]
)
def test_httpx_and_the_openai_client_see_the_413_of_a_10_mb_body(
    server: RemoteServer, body: bytes
) -> None:
    start = time.monotonic()
    resp = httpx.post(
        server.url + CMPL, content=body, headers={"Content-Type": "application/json"}, timeout=30
    )
    took = time.monotonic() - start
    error = _assert_error(resp, 413, None)
    assert error["type"] == "RequestTooLargeError"
    assert took < 5, took
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompt = "x" * TEN_MB if body.startswith(b"{") else "\xff garbage " * (TEN_MB // 10)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="unused", prompt=prompt, max_tokens=1)
    assert refused.value.status_code == 413
    assert "--max-request-body-bytes" in refused.value.message
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_invocations_routes_by_body_as_vllm(server: RemoteServer, greedy_text: str) -> None:
    """SageMaker's `POST /invocations` (issue 28): `messages` is a chat completion, `prompt` a
    completion; anything else is a 400 in OpenAI's shape, as are the routes' own errors. Its
    health check, `/ping`, is `/health`."""
    url = server.url + "/invocations"
    resp = httpx.post(url, json=GREEDY, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["object"] == "text_completion"
    assert resp.json()["choices"][0]["text"] == greedy_text
    chat = {"messages": CHAT, "max_tokens": 4, "temperature": 0}
    via_chat = httpx.post(server.url + CHATS, json=chat, timeout=30).json()
    resp = httpx.post(url, json=chat, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["object"] == "chat.completion"
    assert resp.json()["choices"] == via_chat["choices"]
    with httpx.stream("POST", url, json={**chat, "stream": True}, timeout=30) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"

    for body in ({}, {"model": "x"}, [GREEDY], "hi"):
        error = _assert_error(httpx.post(url, json=body, timeout=30), 400, None)
        assert "Cannot find suitable handler" in error["message"], error
    error = _assert_error(httpx.post(url, content=b"{nope", timeout=30), 400, None)
    assert "JSON decode error" in error["message"]
    _assert_error(httpx.post(url, json={"messages": []}, timeout=30), 400, "messages")
    _assert_error(httpx.post(url, json={"prompt": "hi", "n": 0}, timeout=30), 400, "n")
    _assert_error(httpx.post(url, json={"prompt": "hi", "max_tokens": "x"}), 400, "max_tokens")
    wrong = httpx.post(url, json={**GREEDY, "model": "nope"}, timeout=30)
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"

    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200
