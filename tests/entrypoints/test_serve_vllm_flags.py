"""vLLM's `serve` flags on one real server: --root-path, --disable-fastapi-docs, CORS
(--allowed-origins), --uvicorn-log-level, --enable-log-requests, --chat-template and
--generation-config; vLLM's no-effect flags only warn."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from serve_helpers import RemoteServer

TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:  # type: ignore[no-untyped-def]
    gen_dir = tmp_path_factory.mktemp("generation-config")
    (gen_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    args = [
        "--model",
        str(tiny_model_factory("llama")),
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        str(1 << 22),
        "--max-model-len",
        "128",
        "--root-path",
        "/x",
        "--disable-fastapi-docs",
        "--allowed-origins",
        '["http://a.example"]',
        "--uvicorn-log-level",
        "warning",
        "--enable-log-requests",
        "--chat-template",
        TEMPLATE,
        "--generation-config",
        str(gen_dir),
        "--disable-log-stats",
        "--enforce-eager",
    ]
    # treadle's INFO lines: where it listens (uvicorn, at warning, no longer says) and requests.
    srv = RemoteServer(
        args, tmp_path_factory.mktemp("vllm-flags"), env={"TREADLE_LOGGING_LEVEL": "INFO"}
    )
    yield srv
    srv.stop()


def test_no_effect_flags_warn_in_one_line(server: RemoteServer) -> None:
    assert "treadle serve: warning: --enforce-eager has no effect" in server.output()


def test_root_path_prefix_is_accepted_and_docs_are_off(server: RemoteServer) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/x/health").status_code == 200  # as a proxy may forward it
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 404, path


def test_cors_allows_the_given_origin_only(server: RemoteServer) -> None:
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(
            server.url + "/v1/completions",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        )

    ok = preflight("http://a.example")
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://a.example"
    refused = preflight("http://b.example")
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers


def test_uvicorn_log_level_hides_the_access_log(server: RemoteServer) -> None:
    httpx.get(server.url + "/health")
    assert "GET /health" not in server.output()


def test_chat_template_flag_replaces_the_models(server: RemoteServer) -> None:
    chat = httpx.post(
        server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": chat["tokens"]}).json()
    assert text["prompt"] == "<<hi>>"


def test_generation_config_sets_defaults_and_requests_are_logged(server: RemoteServer) -> None:
    # temperature 0 from generation_config.json: two seeds give the same text.
    texts = [
        httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 8, "seed": seed, "ignore_eos": True},
        ).json()["choices"][0]["text"]
        for seed in (1, 2)
    ]
    assert texts[0] == texts[1]
    sampled = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 1, "temperature": 1.0},
    ).json()
    assert sampled["choices"][0]["finish_reason"] == "length"
    log = server.output()
    assert "Default sampling parameters from generation_config.json" in log
    assert "Received request" in log and "Finished request" in log
    assert "Avg prompt throughput" not in log
