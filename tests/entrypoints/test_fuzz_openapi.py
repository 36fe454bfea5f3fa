"""Property-based fuzzing of a live `treadle serve` with schemathesis: requests generated from
the server's own OpenAPI schema (valid ones, and ones that break it), a bounded number per
operation. No answer may be a 5xx (nor a 5xx error event inside a stream), every answer's
status and content type must be documented (issue 28: 400/404/413 were not, and the probes
answer without a content type), nothing may crash in the server, and it must give the same
greedy text afterwards. Routes that never end (`text/event-stream` alone) are not called.
The server takes `prompt_embeds` (--enable-prompt-embeds), so generated ones reach their
decoder, and some must be refused by it rather than by the flag's absence."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import content_type_conformance, status_code_conformance
from schemathesis.core.result import Ok

from serve_helpers import RemoteServer

EXAMPLES = int(os.environ.get("TREADLE_FUZZ_EXAMPLES", "25"))
"""Examples per operation and generation mode (raise it for a longer hunt)."""
AFFORDABLE = {"n": 4, "max_tokens": 8, "max_completion_tokens": 8}
"""Valid but costly values are lowered to these, so that the run takes about a minute on two
cores whatever is generated (128 samples of 63 tokens each can take a minute on their own)."""
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
CHECKS = [status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory) -> Iterator[RemoteServer]:  # type: ignore[no-untyped-def]
    # A short context keeps every generated request quick on two cores.
    args = [str(tiny_model_factory("llama")), "--max-model-len", "64", "--enable-prompt-embeds"]
    srv = RemoteServer(args, tmp_path_factory.mktemp("fuzz"))
    yield srv
    srv.stop()


def _fuzz(
    server: RemoteServer,
    operation: schemathesis.APIOperation,
    mode: GenerationMode,
    decoded: list[str],
) -> int:
    """Send up to EXAMPLES generated requests; returns how many were sent. `decoded` gets the
    message of each refusal of a `prompt_embeds` by its decoder."""
    sent = 0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every run: a failure reproduces
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        nonlocal sent
        if isinstance(case.body, dict):
            for key, most in AFFORDABLE.items():
                value = case.body.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool) and value > most:
                    case.body[key] = most
        response = case.call(base_url=server.url, timeout=180)
        sent += 1
        where = f"{case.method} {case.path} {case.body!r:.400}"
        assert response.status_code < 500, f"{where} -> {response.status_code} {response.text}"
        if "text/event-stream" in str(response.headers.get("content-type")):
            assert '"code": 5' not in response.text, f"{where} -> {response.text:.400}"
        case.validate_response(response, checks=CHECKS)
        error = response.json().get("error") if response.status_code == 400 else None
        if isinstance(error, dict) and error.get("param") == "prompt_embeds":
            assert "--enable-prompt-embeds" not in error["message"], error
            decoded.append(error["message"])

    try:
        check()
    except Unsatisfiable:  # nothing to break in an operation without parameters
        assert mode is GenerationMode.NEGATIVE, operation.path
    return sent


def test_the_schema_documents_errors_probes_and_streams(server: RemoteServer) -> None:
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)  # a bad body is a 400 here
            for code in ("413", "500"):
                assert responses[code]["content"] == error, (method, path, code)
    for path in ("/health", "/ping"):  # vLLM's empty 200
        responses = schema["paths"][path]["get"]["responses"]
        assert "content" not in responses["200"] or not responses["200"]["content"]
        assert responses["503"]["content"] == error
        live = httpx.get(server.url + path, timeout=10)
        assert live.status_code == 200 and "content-type" not in live.headers and not live.content
    responses = schema["paths"]["/health/ready"]["get"]["responses"]
    assert responses["503"]["content"] == error
    assert httpx.get(server.url + "/health/ready", timeout=10).json() == {"status": "ready"}
    paths = schema["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/invocations"):
        responses = paths[path]["post"]["responses"]
        assert {"application/json", "text/event-stream"} <= set(responses["200"]["content"])
        assert all(responses[code]["content"] == error for code in ("400", "404", "503"))
    events = paths["/dashboard/events"]["get"]["responses"]["200"]["content"]
    assert set(events) == {"text/event-stream"}
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    error_info = schema["components"]["schemas"]["ErrorInfo"]
    assert set(error_info["properties"]) == {"message", "type", "param", "code"}


def _only_streams(operation: schemathesis.APIOperation) -> bool:
    """Whether the operation's 200 is a stream of events and nothing else (it never ends)."""
    content = operation.definition.raw["responses"]["200"].get("content", {})
    return set(content) == {"text/event-stream"}


def test_generated_requests_get_documented_answers_never_a_5xx(server: RemoteServer) -> None:
    before = httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=30).json()
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations() if isinstance(r, Ok)]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/invocations", "/tokenize"} <= paths
    streams = {op.path for op in operations if _only_streams(op)}
    assert streams == {"/dashboard/events"}
    operations = [op for op in operations if op.path not in streams]
    sent, decoded = 0, []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            sent += _fuzz(server, operation, mode, decoded)
    assert sent >= len(operations) * 2
    assert decoded  # generated prompt_embeds reached the decoder

    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    after = httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=30).json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    log = server.output()
    for sign in ("Traceback", "Exception in ASGI application", "Could not add request"):
        assert sign not in log, log[-4000:]
