"""`--reasoning-parser qwen3` as a vLLM user meets it (issue 42 item 7): the real `openai`
client gets `reasoning_content` beside `content`, whole and streamed. The model is a tiny
Qwen3 whose output is wired in its weights: each token's successor is fixed (attention and
MLP write nothing, so the last token alone picks the next), so after the chat prompt's last
token it always says `<think>ok</think>Yes` and ends; `<think>` and `</think>` are added tokens,
as in Qwen3's tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from serve_helpers import RemoteServer

ASK = [{"role": "user", "content": "Is it?"}]


def build_thinking_model(path: Path) -> Path:
    """A Qwen3 whose greedy output after "\\n" is `<think>ok</think>Yes<|im_end|>`."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from treadle.config import resolve_model
    from treadle.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None))
    tokenizer.add_tokens(["<think>", "</think>"])
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    [newline] = tokenizer.encode("\n")
    [ok] = tokenizer.encode("ok")
    [yes] = tokenizer.encode("Yes")
    chain = [newline, think, ok, end, yes, tokenizer.eos_token_id]
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.ones_like(param) if "norm" in name else torch.zeros_like(param))
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        for i, (token, successor) in enumerate(zip(chain, chain[1:], strict=False)):
            embed[token, i] = 1.0
            head[successor, i] = 10.0
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    model = build_thinking_model(tmp_path_factory.mktemp("thinking-qwen3"))
    srv = RemoteServer(
        [str(model), "--reasoning-parser", "qwen3", "--max-model-len", "256"],
        tmp_path_factory.mktemp("reasoning"),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=ASK, **kwargs)  # type: ignore[call-overload]


def test_reasoning_content_beside_content(client: openai.OpenAI) -> None:
    message = _ask(client).choices[0].message
    assert message.content == "Yes"
    extra = message.model_extra or {}
    assert extra["reasoning_content"] == "ok"
    assert extra["reasoning"] == "ok"  # vLLM's newer name for it


def test_streamed_reasoning_then_content(client: openai.OpenAI) -> None:
    thought, content, order = "", "", []
    for chunk in _ask(client, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            piece = (delta.model_extra or {}).get("reasoning_content")
            if piece:
                thought += piece
                order.append("reasoning")
            if delta.content:
                content += delta.content
                order.append("content")
    assert (thought, content) == ("ok", "Yes")
    assert order == sorted(order, key=["reasoning", "content"].index), order


def test_include_reasoning_false_drops_it(client: openai.OpenAI) -> None:
    message = _ask(client, extra_body={"include_reasoning": False}).choices[0].message
    assert message.content == "Yes"
    assert (message.model_extra or {})["reasoning_content"] is None
    chunks = list(_ask(client, stream=True, extra_body={"include_reasoning": False}))
    assert not any(
        "reasoning_content" in (c.delta.model_extra or {}) for k in chunks for c in k.choices
    )
    assert "".join(c.delta.content or "" for k in chunks for c in k.choices) == "Yes"


def test_enable_thinking_false_is_all_content(client: openai.OpenAI) -> None:
    body = {"chat_template_kwargs": {"enable_thinking": False}}
    message = _ask(client, extra_body=body).choices[0].message
    assert message.content == "<think>ok</think>Yes"
    assert (message.model_extra or {})["reasoning_content"] is None


def test_structured_outputs_while_thinking_are_refused(server: RemoteServer) -> None:
    body = {
        "messages": ASK,
        "response_format": {"type": "json_object"},
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "--reasoning-parser" in r.json()["error"]["message"]
    body["chat_template_kwargs"] = {"enable_thinking": False}
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
