"""`/v1/embeddings` and `LLM.embed` (issue 23 item 4) on a tiny random Llama: vectors equal to
transformers' final hidden state (last position, or the mean) normalised, through the real
`openai` client (float and base64) and langchain's `OpenAIEmbeddings`; embedding requests
batched with generation on one engine; refusals."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from serve_helpers import RemoteServer

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings for retrieval " * 12]


@pytest.fixture(scope="module")
def model(tiny_model_factory: Any) -> Path:
    return Path(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    srv = RemoteServer([str(model), "--max-model-len", "512"], tmp_path_factory.mktemp("embed"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def reference(model: Path, text: str, pooling: str) -> torch.Tensor:
    """transformers' final hidden state of the text (with the tokenizer's special tokens, as
    the server adds them), pooled and normalised."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModel.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        hidden = hf(torch.tensor([tokenizer(text).input_ids])).last_hidden_state[0]
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return vector / vector.norm()


def cosine(a: list[float], b: torch.Tensor) -> float:
    got = torch.tensor(a)
    return float(got @ b / got.norm() / b.norm())


def test_float_and_base64_match_transformers(client: openai.OpenAI, model: Path) -> None:
    name = client.models.list().data[0].id
    floats = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model=name, input=TEXTS)  # the client asks for base64
    assert [d.index for d in floats.data] == [0, 1]
    for i, text in enumerate(TEXTS):
        ref = reference(model, text, "last")
        assert len(floats.data[i].embedding) == ref.shape[0]
        assert cosine(floats.data[i].embedding, ref) >= 0.9999
        assert torch.allclose(
            torch.tensor(packed.data[i].embedding), torch.tensor(floats.data[i].embedding)
        )
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0


def test_token_id_inputs_and_langchain(server: RemoteServer, model: Path) -> None:
    from langchain_openai import OpenAIEmbeddings
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(TEXTS[0]).input_ids
    r = httpx.post(server.url + "/v1/embeddings", json={"input": [ids, ids]}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert cosine(data[0]["embedding"], reference(model, TEXTS[0], "last")) >= 0.9999
    assert r.json()["usage"]["prompt_tokens"] == 2 * len(ids)
    lc = OpenAIEmbeddings(
        model="unused",  # the server answers to its own name; langchain sends this one
        base_url=server.url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        check_embedding_ctx_length=False,  # no tiktoken (it would download its vocabulary)
    )
    lc.model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    vectors = lc.embed_documents(TEXTS)
    query = lc.embed_query(TEXTS[1])
    assert cosine(vectors[1], reference(model, TEXTS[1], "last")) >= 0.9999
    assert cosine(query, torch.tensor(vectors[1])) >= 0.9999


def test_embeddings_share_steps_with_generation(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    """Embedding requests that come while a long generation runs are batched into its steps:
    each is answered while the generation is still streaming (an engine that ran them only
    between or after generations would answer them after its last token), and the
    generation's text is the one it has alone."""
    name = client.models.list().data[0].id
    body = {"model": name, "prompt": "Once", "max_tokens": 480, "temperature": 0}
    body["ignore_eos"] = True
    alone = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    started, finished, pieces = threading.Event(), [], []

    def generate() -> None:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
                    started.set()
        finished.append(time.monotonic())

    thread = threading.Thread(target=generate)
    thread.start()
    assert started.wait(60)
    answered = []
    for _ in range(5):
        out = client.embeddings.create(model=name, input=TEXTS[0], encoding_format="float")
        assert len(out.data) == 1
        answered.append(time.monotonic())
    thread.join(timeout=120)
    assert finished and max(answered) < finished[0], "embeddings waited for the generation"
    assert "".join(pieces) == alone["choices"][0]["text"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "bogus": 1}, "bogus"),
        ({"input": [10**9]}, "input"),
    ],
)
def test_bad_requests_are_400s(server: RemoteServer, body: dict[str, Any], param: str) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"], r.text


def test_offline_embed_last_and_mean(model: Path) -> None:
    from treadle import LLM

    os.environ["TREADLE_ENABLE_MULTIPROCESSING"] = "0"
    try:
        for pooling in ("last", "mean"):
            llm = LLM(str(model), max_model_len=512, pooling_type=pooling)
            try:
                outs = llm.embed(TEXTS, use_tqdm=False)
                for text, out in zip(TEXTS, outs, strict=True):
                    assert cosine(out.outputs.embedding, reference(model, text, pooling)) >= 0.9999
            finally:
                llm.shutdown()
    finally:
        del os.environ["TREADLE_ENABLE_MULTIPROCESSING"]


def test_tensor_parallel_embeddings_equal_one_rank(model: Path) -> None:
    """Under -tp 2 the pooled vectors are those of one rank (the final hidden state is whole
    on every rank after the last all-reduce)."""
    from treadle import LLM

    llm = LLM(str(model), max_model_len=512, tensor_parallel_size=2)
    try:
        outs = llm.embed(TEXTS, use_tqdm=False)
    finally:
        llm.shutdown()
    for text, out in zip(TEXTS, outs, strict=True):
        assert cosine(out.outputs.embedding, reference(model, text, "last")) >= 0.9999
