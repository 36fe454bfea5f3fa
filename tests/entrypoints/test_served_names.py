"""The names the served model answers to (issue 28): vLLM's (`--served-model-name`, several
allowed; else the model's path as given), then treadle's short name and the path as given;
responses report the first, /v1/models lists vLLM's."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from serve_helpers import RemoteServer
from treadle.cli.main import build_parser
from treadle.cli.serve import prepare
from treadle.config import DEFAULT_MODEL_NAME, served_names
from treadle.engine_args import EngineArgs


def parse(*argv: str) -> argparse.Namespace:
    args, extras = build_parser().parse_known_args(["serve", *argv])
    assert extras == [], extras
    return args


def test_served_names_follow_vllm_then_treadle_s_short_name() -> None:
    assert served_names("/models/x/", None) == (("x",), ("/models/x/",))
    assert served_names("models/x.gguf", []) == (("x.gguf",), ("models/x.gguf",))
    assert served_names(None, None) == ((DEFAULT_MODEL_NAME,), ())
    assert served_names("/m/x", ["a", "b", "a"]) == (("a", "b"), ("x", "/m/x"))
    assert served_names("/m/x", "x") == (("x",), ("/m/x",))  # LLM(served_model_name="x")
    with pytest.raises(ValueError, match="non-empty"):
        served_names("/m/x", [""])


def test_served_model_name_takes_several_names(default_model_path: str) -> None:
    config, _, name = prepare(parse("--model", default_model_path))
    assert name == os.path.basename(default_model_path)
    assert config.model.served_model_name == (name,)
    assert default_model_path in config.model.also_served_as
    config, _, name = prepare(parse(default_model_path, "--served-model-name", "a", "b"))
    assert name == "a" and config.model.served_model_name == ("a", "b")
    config = EngineArgs(served_model_name="solo").create_engine_config()
    assert config.model.served_model_name == ("solo",)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_factory
) -> Iterator[tuple[RemoteServer, str]]:  # type: ignore[no-untyped-def]
    path = str(tiny_model_factory("llama"))
    args = ["--model", path, "--served-model-name", "first", "second", "--max-model-len", "256"]
    srv = RemoteServer(args, tmp_path_factory.mktemp("names"))
    yield srv, path
    srv.stop()


def test_every_name_reaches_the_model_and_the_first_is_reported(
    server: tuple[RemoteServer, str],
) -> None:
    srv, path = server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    short = Path(path).name
    for name in ("first", "second", path, short):
        out = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert out.model == "first"
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.model == "first"
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="third", prompt="hi", max_tokens=2)
    # The 404 names what is served, as /v1/models lists it (issue 42 item 4).
    assert missing.value.body["message"] == (  # type: ignore[index]
        "The model `third` does not exist. This server serves `first`, `second`."
    )
    listed = httpx.get(srv.url + "/v1/models").json()["data"]
    assert [card["id"] for card in listed] == ["first", "second"]  # as vLLM's list
    assert {card["root"] for card in listed} == {"first"}  # no path the client did not give
    schema = httpx.get(srv.url + "/openapi.json").json()
    enum = schema["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert all(json.dumps(name) in json.dumps(enum) for name in ("first", "second", path, short))
