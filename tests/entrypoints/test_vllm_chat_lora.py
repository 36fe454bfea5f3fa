"""The LoRA cases of vLLM's `tests/entrypoints/openai/test_chat.py` (issue 40), run against
`treadle serve` with vLLM's LoRA flags: each case here does what vLLM's case of the same name
does, once on the base model and once on the adapter (`zephyr-lora`, as vLLM names its own),
through the real `openai` client (vLLM's async one; the sync one here). vLLM serves zephyr-7b-beta with a LoRA of it; here the tiny
random Llama with an adapter of rank 16 on every projection made with `peft`, so the
assertions that read the text keep to what a random model's text allows (vLLM's
`prompt_tokens=37` is zephyr's template; here the count `/tokenize` gives for the messages)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from lora_helpers import TARGETS_ATTN, TARGETS_MLP, make_adapter
from serve_helpers import RemoteServer

ADAPTER = "zephyr-lora"
QUESTION = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "what is 1+1?"},
]


@pytest.fixture(scope="module")
def server(lora_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    """vLLM's server arguments for these cases, less what a GPU needs (`--enforce-eager`,
    `--dtype bfloat16`): one server for the module."""
    root = tmp_path_factory.mktemp("vllm-chat-lora")
    adapter = make_adapter(lora_base, root / "zephyr-lora", 16, TARGETS_ATTN + TARGETS_MLP, 7)
    args = [str(lora_base), "--dtype", "float32", "--max-model-len", "512", "--enable-lora"]
    args += ["--lora-modules", f"{ADAPTER}={adapter}", "--max-lora-rank", "64"]
    args += ["--max-cpu-loras", "2", "--max-num-seqs", "128"]
    srv = RemoteServer(args, root)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def base_name(server: RemoteServer) -> str:
    models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    parents = {m["id"]: m.get("parent") for m in models}
    assert parents[ADAPTER] in parents, parents  # the adapter's parent is the base model
    return next(name for name, parent in parents.items() if parent is None)


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(params=["base", ADAPTER])
def model_name(request: pytest.FixtureRequest, base_name: str) -> str:
    return base_name if request.param == "base" else ADAPTER


# vLLM: test_no_logprobs_chat
def test_no_logprobs_chat(client: openai.OpenAI, model_name: str) -> None:
    out = client.chat.completions.create(
        model=model_name,
        messages=QUESTION,  # type: ignore[arg-type]
        max_completion_tokens=5,
        temperature=0.0,
        logprobs=False,
    )
    assert out.model == model_name
    assert out.choices[0].logprobs is None


# vLLM: test_zero_logprobs_chat
def test_zero_logprobs_chat(client: openai.OpenAI, model_name: str) -> None:
    out = client.chat.completions.create(
        model=model_name,
        messages=QUESTION,  # type: ignore[arg-type]
        max_completion_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=0,
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert logprobs.content[0].top_logprobs == []


# vLLM: test_some_logprobs_chat
def test_some_logprobs_chat(client: openai.OpenAI, model_name: str) -> None:
    out = client.chat.completions.create(
        model=model_name,
        messages=QUESTION,  # type: ignore[arg-type]
        max_completion_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content[0].top_logprobs) == 5


# vLLM: test_too_many_chat_logprobs
def test_too_many_chat_logprobs(client: openai.OpenAI, model_name: str) -> None:
    # over the default --max-logprobs 20, streamed: refused before or while streaming
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        stream = client.chat.completions.create(
            model=model_name,
            messages=QUESTION,  # type: ignore[arg-type]
            max_completion_tokens=10,
            logprobs=True,
            top_logprobs=21,
            stream=True,
        )
        for _ in stream:
            pass
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model_name,
            messages=QUESTION,  # type: ignore[arg-type]
            max_completion_tokens=10,
            logprobs=True,
            top_logprobs=30,
            stream=False,
        )
    # and the server still answers
    out = client.chat.completions.create(
        model=model_name,
        messages=QUESTION,  # type: ignore[arg-type]
        max_completion_tokens=10,
        stream=False,
    )
    assert out.choices[0].message.content is not None


# vLLM: test_single_chat_session
def test_single_chat_session(client: openai.OpenAI, server: RemoteServer, model_name: str) -> None:
    messages: list[dict[str, str]] = list(QUESTION)
    prompt = httpx.post(
        server.url + "/tokenize",
        json={"model": model_name, "messages": messages, "add_generation_prompt": True},
        timeout=30,
    ).json()["count"]
    out = client.chat.completions.create(
        model=model_name,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=10,
        logprobs=True,
        top_logprobs=5,
        seed=0,  # (vLLM's zephyr never ends in 10 tokens; a random model might, unseeded)
    )
    assert out.id is not None
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage == openai.types.CompletionUsage(
        completion_tokens=10, prompt_tokens=prompt, total_tokens=prompt + 10
    )
    message = choice.message
    assert message.role == "assistant"
    assert message.content is not None and len(message.content) >= 10
    # a second turn on the first's answer
    messages.append({"role": "assistant", "content": message.content})
    messages.append({"role": "user", "content": "express your result in json"})
    out = client.chat.completions.create(
        model=model_name,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=10,
    )
    assert out.choices[0].message.content is not None


# vLLM: test_chat_streaming
def test_chat_streaming(client: openai.OpenAI, model_name: str) -> None:
    whole = client.chat.completions.create(
        model=model_name,
        messages=QUESTION,  # type: ignore[arg-type]
        max_completion_tokens=10,
        temperature=0.0,
    )
    text = whole.choices[0].message.content
    stop_reason = whole.choices[0].finish_reason
    stream = client.chat.completions.create(
        model=model_name,
        messages=QUESTION,  # type: ignore[arg-type]
        max_completion_tokens=10,
        temperature=0.0,
        stream=True,
        logprobs=True,  # (to know the last chunk's tokens: see below)
    )
    pieces: list[str] = []
    finishes = 0
    for chunk in stream:
        assert chunk.model == model_name
        delta = chunk.choices[0].delta
        if delta.role:
            assert delta.role == "assistant"
        if delta.content:
            pieces.append(delta.content)
        if chunk.choices[0].finish_reason is not None:
            finishes += 1
    assert finishes == 1  # in the last chunk only
    assert chunk.choices[0].finish_reason == stop_reason
    # the last chunk carries the last text as well (unless its tokens are all bytes of a
    # character not yet complete, which a random model's text may end with: those give none)
    last = chunk.choices[0].logprobs
    assert last is not None and last.content
    assert delta.content or all(t.token.endswith("\ufffd") for t in last.content), last
    assert "".join(pieces) == text


# vLLM: test_chat_completion_stream_options
def test_chat_completion_stream_options(client: openai.OpenAI, model_name: str) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    common = {"model": model_name, "messages": messages, "max_completion_tokens": 10}
    # include_usage false: no chunk has usage
    stream = client.chat.completions.create(
        **common, temperature=0.0, stream=True, stream_options={"include_usage": False}
    )
    for chunk in stream:
        assert chunk.usage is None
    # include_usage true, continuous_usage_stats false: one last chunk with usage, no choices
    stream = client.chat.completions.create(
        **common,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": False},
    )
    chunks = list(stream)
    finished = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1 and finished[0] == len(chunks) - 2
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens > 0 and last.usage.completion_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    # stream_options without stream: refused, whatever it says
    for options in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                **common,
                temperature=0.0,
                stream=False,
                stream_options=options,  # type: ignore[arg-type]
            )
    # continuous_usage_stats: every chunk's usage, the completion tokens growing to 10
    stream = client.chat.completions.create(
        **common,
        extra_body={"min_tokens": 10},
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    last_completion = 0
    for chunk in stream:
        usage = chunk.usage
        assert usage is not None and usage.prompt_tokens >= 0
        assert (
            last_completion == 0
            or usage.completion_tokens > last_completion
            or (not chunk.choices and usage.completion_tokens == last_completion)
        )
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        last_completion = usage.completion_tokens
    assert last_completion == 10
