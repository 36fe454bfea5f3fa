"""`prompt_embeds` on `/v1/completions` with --enable-prompt-embeds (issue 23), through the real
`openai` client as vLLM's example sends them (`prompt=""`, `extra_body`): the model's own
embedding rows give the greedy text of the prompt, streamed and not; every hostile tensor is
a 400 naming `prompt_embeds`, and the server serves the same greedy text after."""

from __future__ import annotations

import base64
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from serve_helpers import RemoteServer

HIDDEN = 64
TEXT = "The capital of France is a city by a river, and"
GREEDY: dict[str, Any] = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}


def saved(obj: object) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


def pickle_zip(pickle: bytes) -> str:
    """A torch.save-shaped zip whose data.pkl is `pickle`."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle)
        z.writestr("archive/byteorder", "little")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:  # type: ignore[no-untyped-def]
    return Path(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(
        [str(model_dir), "--max-model-len", "128", "--enable-prompt-embeds"],
        tmp_path_factory.mktemp("prompt-embeds"),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def ids(server: RemoteServer) -> list[int]:
    resp = httpx.post(server.url + "/tokenize", json={"prompt": TEXT}, timeout=30)
    return list(resp.json()["tokens"])


@pytest.fixture(scope="module")
def embeds(model_dir: Path, ids: list[int]) -> torch.Tensor:
    return load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"][ids]


@pytest.fixture(scope="module")
def greedy_text(client: openai.OpenAI, model: str, ids: list[int]) -> str:
    """The greedy text of the prompt's token ids, before any embeddings reached the server."""
    out = client.completions.create(model=model, prompt=ids, extra_body=GREEDY)  # type: ignore[arg-type]
    assert out.choices[0].text
    return out.choices[0].text


def test_own_rows_give_the_prompts_greedy_text(
    client: openai.OpenAI, model: str, embeds: torch.Tensor, greedy_text: str
) -> None:
    out = client.completions.create(
        model=model, prompt="", extra_body={**GREEDY, "prompt_embeds": saved(embeds)}
    )  # type: ignore[call-overload]
    assert out.choices[0].text == greedy_text
    assert out.usage is not None and out.usage.prompt_tokens == embeds.shape[0]


def test_streamed_too(
    client: openai.OpenAI, model: str, embeds: torch.Tensor, greedy_text: str
) -> None:
    stream = client.completions.create(
        model=model,
        prompt="",
        stream=True,
        extra_body={**GREEDY, "prompt_embeds": saved(embeds)},
    )  # type: ignore[call-overload]
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == greedy_text


def test_a_list_of_embeds_then_the_prompt_each_a_choice(
    client: openai.OpenAI, model: str, embeds: torch.Tensor, ids: list[int], greedy_text: str
) -> None:
    out = client.completions.create(
        model=model,
        prompt=[ids],
        extra_body={**GREEDY, "prompt_embeds": [saved(embeds), saved(embeds.half())]},
    )  # type: ignore[call-overload]
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and texts[0] == texts[2] == greedy_text


def test_echo_and_prompt_logprobs_are_refused_with_embeds(
    server: RemoteServer, embeds: torch.Tensor
) -> None:
    body = {**GREEDY, "prompt": "", "prompt_embeds": saved(embeds)}
    for extra, param in (({"echo": True}, "echo"), ({"prompt_logprobs": 1}, "prompt_logprobs")):
        resp = httpx.post(server.url + "/v1/completions", json={**body, **extra}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


HOSTILE: dict[str, Any] = {
    "wrong width": saved(torch.randn(3, HIDDEN + 1)),
    "1-D": saved(torch.randn(HIDDEN)),
    "3-D": saved(torch.randn(1, 3, HIDDEN)),
    "NaN": saved(torch.full((2, HIDDEN), float("nan"))),
    "inf": saved(torch.full((2, HIDDEN), float("inf"))),
    "int64": saved(torch.zeros(2, HIDDEN, dtype=torch.int64)),
    "float64": saved(torch.zeros(2, HIDDEN, dtype=torch.float64)),
    "sparse": saved(torch.eye(HIDDEN)[:3].to_sparse()),
    "not contiguous": saved(torch.randn(HIDDEN, 3).t()),
    "too many rows": saved(torch.randn(128, HIDDEN)),
    "a dict": saved({"a": torch.randn(2, HIDDEN)}),
    "os.system": pickle_zip(b"cos\nsystem\n(S'echo pwned'\ntR."),
    "garbage base64": "!!! not base64 !!!",
    "not a zip": base64.b64encode(b"hello world").decode(),
    "over the cap": "A" * 200_000,
    "a number": 12,
    "a list of numbers": [1, 2],
    "an empty list": [],
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_tensor_is_a_400_and_the_server_goes_on(
    server: RemoteServer, greedy_text: str, ids: list[int], name: str
) -> None:
    body = {**GREEDY, "prompt": "", "prompt_embeds": HOSTILE[name]}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "prompt_embeds", resp.text
    again = httpx.post(server.url + "/v1/completions", json={**GREEDY, "prompt": ids}, timeout=30)
    assert again.json()["choices"][0]["text"] == greedy_text


def test_truncation_keeps_the_last_rows_as_it_keeps_the_last_tokens(
    client: openai.OpenAI, model: str, embeds: torch.Tensor, ids: list[int]
) -> None:
    cut = {**GREEDY, "truncate_prompt_tokens": 5}
    by_ids = client.completions.create(model=model, prompt=ids[-5:], extra_body=GREEDY)  # type: ignore[arg-type]
    by_embeds = client.completions.create(
        model=model, prompt="", extra_body={**cut, "prompt_embeds": saved(embeds)}
    )  # type: ignore[call-overload]
    assert by_embeds.choices[0].text == by_ids.choices[0].text
    assert by_embeds.usage is not None and by_embeds.usage.prompt_tokens == 5


def test_hostile_tensors_do_not_raise_the_servers_peak_memory(server: RemoteServer) -> None:
    """The decoder allocates nothing past its cap: after one oversized body (the HTTP layer's
    own cost), the hostile payloads, each several times, leave the API server's peak RSS
    (VmHWM) within a few MiB."""

    def peak_kib() -> int:
        status = Path(f"/proc/{server.proc.pid}/status").read_text()
        return int(
            next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))
        )

    big = {**GREEDY, "prompt": "", "prompt_embeds": "A" * (6 << 20)}
    assert httpx.post(server.url + "/v1/completions", json=big, timeout=60).status_code == 400
    before = peak_kib()
    for _ in range(3):
        for payload in [*HOSTILE.values(), big["prompt_embeds"]]:
            body = {**GREEDY, "prompt": "", "prompt_embeds": payload}
            assert (
                httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 400
            )
    assert peak_kib() - before < 16 << 10, (before, peak_kib())
