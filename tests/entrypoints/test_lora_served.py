"""LoRA adapters on `treadle serve` as vLLM's users reach them (issue 40): `--enable-lora
--lora-modules name=path`, `"model": "<adapter>"` through the real openai client (PEFT's
merged greedy text), `/v1/models` with `parent`, loading and unloading while streams run
(TREADLE_ALLOW_RUNTIME_LORA_UPDATING=1), a 404 that names what is served, hostile adapters
refused with their reason, and a kill -9 of the engine core under streams on 3 adapters."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from lora_helpers import TARGETS_ATTN, TARGETS_MLP, MergedReference, make_adapter
from serve_helpers import RemoteServer

PROMPT = "The capital of France is"
MAX = 12


@pytest.fixture(scope="module")
def base(lora_base: Path) -> Path:
    return lora_base


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    out = {
        "a1": make_adapter(base, root / "a1", 8, ["q_proj", "v_proj", "down_proj"], seed=1),
        "a2": make_adapter(base, root / "a2", 16, TARGETS_ATTN + TARGETS_MLP, seed=2),
        "a3": make_adapter(base, root / "a3", 8, TARGETS_MLP, seed=3),
    }
    big = shutil.copytree(out["a1"], root / "too-big")
    config = json.loads((big / "adapter_config.json").read_text())
    config["r"] = 64
    (big / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def reference(merged_reference: MergedReference) -> MergedReference:
    return merged_reference


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, base: Path, adapters: dict[str, Path]
) -> Iterator[RemoteServer]:
    srv = RemoteServer(
        [
            str(base),
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--enable-lora",
            "--max-loras",
            "3",
            "--max-cpu-loras",
            "4",
            "--lora-modules",
            f"a1={adapters['a1']}",
            json.dumps({"name": "a2", "path": str(adapters["a2"]), "base_model_name": "tiny"}),
        ],
        tmp_path_factory.mktemp("lora-served"),
        env={"TREADLE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def complete(client: openai.OpenAI, model: str, prompt: str = PROMPT, n: int = MAX) -> Any:
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )


def expected(reference: MergedReference, adapter: Path | None, server: RemoteServer) -> str:
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    out = reference.greedy(adapter, ids, MAX)
    return reference_text(reference, out)


def reference_text(reference: MergedReference, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(reference.base).decode(ids))


def test_models_lists_the_adapters_with_their_parent(client: openai.OpenAI) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert {"a1", "a2"} <= set(cards)
    base = next(m.id for m in client.models.list().data if m.id not in ("a1", "a2"))
    assert cards["a1"].parent == base and cards["a2"].parent == "tiny"  # type: ignore[attr-defined]


def test_each_adapter_gives_peft_merged_text(
    server: RemoteServer,
    client: openai.OpenAI,
    adapters: dict[str, Path],
    reference: MergedReference,
) -> None:
    for name in ("a1", "a2"):
        out = complete(client, name)
        assert out.model == name
        assert out.choices[0].text == expected(reference, adapters[name], server), name
    base = client.models.list().data[0].id
    assert complete(client, base).choices[0].text == expected(reference, None, server)


def test_an_unknown_model_is_a_404_that_names_what_is_served(server: RemoteServer) -> None:
    r = httpx.post(
        server.url + "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1}
    )
    assert r.status_code == 404
    assert "`a1`" in r.text and "`a2`" in r.text


def post(server: RemoteServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_hostile_loads_are_refused_with_their_reason(
    server: RemoteServer, adapters: dict[str, Path], base: Path
) -> None:
    root = adapters["a1"].parent
    base_name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    for body, needle in (
        ({"lora_name": "x", "lora_path": str(root / "too-big")}, "rank 64"),
        ({"lora_name": "x", "lora_path": "/etc"}, "outside the folders"),
        ({"lora_name": "x", "lora_path": f"{root}/../{root.name}/../../"}, "outside the folders"),
        ({"lora_name": "x", "lora_path": str(root / "missing")}, "not a directory"),
        ({"lora_name": base_name, "lora_path": str(adapters["a3"])}, "base model"),
        ({"lora_name": "a1", "lora_path": str(adapters["a3"])}, "already loaded"),
        ({"lora_name": "x"}, "lora_path"),
    ):
        r = post(server, "/v1/load_lora_adapter", body)
        assert r.status_code == 400, (body, r.text)
        assert needle in r.text, (needle, r.text)
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 400


def test_load_and_unload_while_16_streams_run(
    server: RemoteServer,
    client: openai.OpenAI,
    adapters: dict[str, Path],
    reference: MergedReference,
) -> None:
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(adapters["a3"])})
    assert r.status_code == 200, r.text
    assert "a3" in {m.id for m in client.models.list().data}
    want = expected(reference, adapters["a3"], server)
    assert complete(client, "a3").choices[0].text == want
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(complete, client, "a3", PROMPT, 48) for _ in range(16)]
        time.sleep(0.3)
        r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a3"})
        assert r.status_code == 200, r.text
        texts = [f.result(120).choices[0].text for f in futures]
    assert all(t.startswith(want) for t in texts)  # every stream finished, none lost
    assert "a3" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        complete(client, "a3")


def test_kill_9_of_the_engine_core_under_streams_on_3_adapters(
    server: RemoteServer, client: openai.OpenAI, adapters: dict[str, Path]
) -> None:
    r = post(
        server, "/v1/load_lora_adapter", {"lora_name": "a3b", "lora_path": str(adapters["a3"])}
    )
    assert r.status_code == 200, r.text
    names = ["a1", "a2", "a3b", "a1", "a2", "a3b", "a1", "a2"]
    prompts = [f"Story number {i} begins" for i in range(len(names))]

    seen = [0] * len(names)

    def stream(i: int) -> str:
        text = ""
        for chunk in client.completions.create(
            model=names[i],
            prompt=prompts[i],
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            text += chunk.choices[0].text
            seen[i] += 1
        return text

    def run(kill: bool) -> list[str]:
        seen[:] = [0] * len(names)
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            futures = [pool.submit(stream, i) for i in range(len(names))]
            if kill:
                deadline = time.monotonic() + 60
                while min(seen) < 3:
                    assert time.monotonic() < deadline, seen
                    time.sleep(0.01)
                os.kill(server.pid_of("treadle::EngineCore_DP0"), signal.SIGKILL)
            return [f.result(180) for f in futures]

    undisturbed = run(kill=False)
    restarts = restart_count(server)
    assert run(kill=True) == undisturbed
    assert restart_count(server) == restarts + 1


def restart_count(server: RemoteServer) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("treadle:engine_restarts_total")
    )
