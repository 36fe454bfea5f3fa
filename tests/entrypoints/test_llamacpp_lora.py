"""llama.cpp's LoRA interface where it maps onto treadle's (issue 40): `GET /lora-adapters`
lists the `--lora-modules` adapters as `[{"id", "path", "scale"}]`, `POST /lora-adapters`
with `[{"id", "scale"}]` picks the adapter /completion applies to requests that name none, a
request's `"lora": [{"id", "scale"}]` (or `"model": "<adapter>"`) picks its own; scales other
than 1 and 0, or two adapters at once, are refused with the reason. The adapter's text is
the one /v1/completions gives for the adapter by name (itself PEFT's, test_llm_lora.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lora_helpers import TARGETS_ATTN, TARGETS_MLP, make_adapter
from serve_helpers import RemoteServer
from treadle.frontend.loras import llamacpp_flag_refusal

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapters(lora_base: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("llamacpp-adapters")
    return [
        make_adapter(lora_base, root / "a0", 8, TARGETS_ATTN, seed=11),
        make_adapter(lora_base, root / "a1", 16, TARGETS_ATTN + TARGETS_MLP, seed=12),
    ]


@pytest.fixture(scope="module")
def server(
    lora_base: Path, adapters: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    args = [str(lora_base), "--dtype", "float32", "--max-model-len", "256", "--enable-lora"]
    args += ["--max-loras", "2", "--lora-modules", f"a0={adapters[0]}", f"a1={adapters[1]}"]
    srv = RemoteServer(args, tmp_path_factory.mktemp("llamacpp-lora"))
    yield srv
    srv.stop()


def completion(server: RemoteServer, **fields: Any) -> httpx.Response:
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, **fields}
    return httpx.post(server.url + "/completion", json=body, timeout=60)


def text(server: RemoteServer, **fields: Any) -> str:
    r = completion(server, **fields)
    assert r.status_code == 200, r.text
    return str(r.json()["content"])


def openai_text(server: RemoteServer, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def set_scales(server: RemoteServer, entries: Any) -> httpx.Response:
    return httpx.post(server.url + "/lora-adapters", json=entries, timeout=30)


def test_get_lora_adapters_lists_them_as_llama_server(
    server: RemoteServer, adapters: list[Path]
) -> None:
    listed = httpx.get(server.url + "/lora-adapters", timeout=30).json()
    assert listed == [
        {"id": 0, "path": str(adapters[0]), "scale": 0.0},
        {"id": 1, "path": str(adapters[1]), "scale": 0.0},
    ]


def test_a_requests_lora_or_model_picks_its_adapter(server: RemoteServer) -> None:
    base, a0, a1 = (openai_text(server, m) for m in (server_model(server), "a0", "a1"))
    assert len({base, a0, a1}) == 3  # (the adapters change the text)
    assert text(server) == base
    assert text(server, lora=[{"id": 1, "scale": 1.0}]) == a1
    assert text(server, lora=[{"id": 0, "scale": 1}, {"id": 1, "scale": 0}]) == a0
    assert text(server, model="a1") == a1
    r = completion(server, lora=[{"id": 0, "scale": 1}])
    assert r.json()["model"] == "a0"


def test_post_lora_adapters_applies_one_to_requests_that_name_none(
    server: RemoteServer,
) -> None:
    base, a0 = openai_text(server, server_model(server)), openai_text(server, "a0")
    try:
        r = set_scales(server, [{"id": 0, "scale": 1}])
        assert r.status_code == 200, r.text
        assert [a["scale"] for a in r.json()] == [1.0, 0.0]
        assert text(server) == a0
        assert text(server, lora=[]) == base  # a request's own list: unlisted ones are off
        assert openai_text(server, server_model(server)) == base  # (llama.cpp's endpoints only)
    finally:
        assert set_scales(server, [{"id": 0, "scale": 0}]).status_code == 200
    assert text(server) == base


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        ([{"id": 0, "scale": 0.5}], "whole (1) or not (0)"),
        ([{"id": 0, "scale": 1}, {"id": 1, "scale": 1}], "one adapter"),
        ([{"id": 7, "scale": 1}], "no adapter 7"),
        ({"id": 0}, "must be a list"),
    ],
)
def test_what_treadle_cannot_apply_is_refused_with_the_reason(
    server: RemoteServer, entries: Any, says: str
) -> None:
    for r in (completion(server, lora=entries), set_scales(server, entries)):
        assert r.status_code == 400, r.text
        assert says in r.json()["error"]["message"], r.text
    listed = httpx.get(server.url + "/lora-adapters", timeout=30).json()
    assert [a["scale"] for a in listed] == [0.0, 0.0]  # nothing changed


def test_llama_cpp_lora_flags_are_refused_saying_what_to_use() -> None:
    line = llamacpp_flag_refusal("--lora", "/models/adapter.gguf")
    assert "\n" not in line and "GGUF" in line and "--lora-modules NAME=DIR" in line


def server_model(server: RemoteServer) -> str:
    return str(httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"])
