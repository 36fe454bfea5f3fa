"""`treadle serve` end to end: real processes, real sockets, the real `openai` client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from serve_helpers import RemoteServer, assert_no_leftovers, treadle_titles
from treadle import LLM, SamplingParams

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    srv = RemoteServer(["--max-model-len", "512"], tmp_path_factory.mktemp("default-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    os.environ["TREADLE_ENABLE_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(max_model_len=512)
    finally:
        del os.environ["TREADLE_ENABLE_MULTIPROCESSING"]
    yield llm
    llm.shutdown()


def test_serve_runs_exactly_two_titled_processes(server: RemoteServer) -> None:
    assert treadle_titles(server) == ["treadle::APIServer_0", "treadle::EngineCore_DP0"]


def test_greedy_completion_and_chat_equal_the_offline_engine(
    client: openai.OpenAI, offline: LLM
) -> None:
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = offline.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    got = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=24, temperature=0
    )
    assert got.choices[0].text == expected.text
    assert got.usage is not None
    assert got.usage.prompt_tokens == 5 and got.usage.completion_tokens == len(expected.token_ids)

    expected_chat = offline.chat(CHAT, params, use_tqdm=False)[0].outputs[0]
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=24, temperature=0
    )  # type: ignore[arg-type]
    assert chat.choices[0].message.content == expected_chat.text
    assert chat.choices[0].finish_reason == expected_chat.finish_reason


def test_streamed_text_equals_non_streamed_text(client: openai.OpenAI) -> None:
    kwargs = dict(model="SmolLM2-135M-Instruct", max_tokens=32, temperature=0)
    full = client.chat.completions.create(messages=CHAT, **kwargs)  # type: ignore[call-overload]
    pieces, usage = [], None
    for chunk in client.chat.completions.create(
        messages=CHAT, stream=True, stream_options={"include_usage": True}, **kwargs
    ):  # type: ignore[call-overload]
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    assert "".join(pieces) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    text = client.completions.create(prompt=PROMPT, **kwargs).choices[0].text  # type: ignore[call-overload]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(prompt=PROMPT, stream=True, **kwargs)
        if c.choices
    )  # type: ignore[call-overload]
    assert streamed == text


def test_streamed_choices_with_n_echo_and_logprobs(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    """Two prompts x n=2, streamed: each choice index reassembles its own text (the prompt
    first, with echo) with one logprob entry per prompt and generated token; chat sends each
    choice's role once."""
    kwargs = dict(
        model="SmolLM2-135M-Instruct",
        max_tokens=12,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True},
    )
    prompts = [PROMPT, "Water boils at"]
    texts: dict[int, str] = {}
    tokens: dict[int, int] = {}
    for chunk in client.completions.create(
        prompt=prompts, stream=True, echo=True, logprobs=1, **kwargs
    ):  # type: ignore[call-overload]
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens[c.index] = tokens.get(c.index, 0) + len(c.logprobs.tokens if c.logprobs else [])
    assert sorted(texts) == [0, 1, 2, 3]
    full = client.completions.create(prompt=prompts, **kwargs)  # type: ignore[call-overload]
    for c in full.choices:
        assert texts[c.index] == prompts[c.index // 2] + c.text
    lens = [
        httpx.post(server.url + "/tokenize", json={"prompt": p}).json()["count"] for p in prompts
    ]
    assert tokens == {i: lens[i // 2] + 12 for i in range(4)}, tokens

    roles: dict[int, int] = {}
    content: dict[int, str] = {}
    lp_tokens: dict[int, int] = {}
    for chunk in client.chat.completions.create(
        messages=CHAT, stream=True, logprobs=True, **kwargs
    ):  # type: ignore[call-overload]
        for c in chunk.choices:
            roles[c.index] = roles.get(c.index, 0) + (c.delta.role == "assistant")
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            got = c.logprobs.content if c.logprobs and c.logprobs.content else []
            lp_tokens[c.index] = lp_tokens.get(c.index, 0) + len(got)
    assert roles == {0: 1, 1: 1}
    full_chat = client.chat.completions.create(messages=CHAT, **kwargs)  # type: ignore[call-overload]
    for c in full_chat.choices:
        assert content[c.index] == c.message.content
    assert lp_tokens == {0: 12, 1: 12}


def test_n_logprobs_echo_and_stop(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        max_tokens=5,
        temperature=0.8,
        n=3,
        seed=1,
        logprobs=2,
        echo=True,
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for c in out.choices:
        assert c.text.startswith(PROMPT)
        # with echo: the 5 prompt tokens (the first unscored), then the 5 new ones
        assert c.logprobs is not None and len(c.logprobs.tokens) == 10  # type: ignore[arg-type]
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None  # type: ignore[index]
    stopped = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=20, temperature=0, stop=["."]
    )
    assert stopped.choices[0].finish_reason == "stop" and "." not in stopped.choices[0].text


def test_32_concurrent_streams_finish_with_the_right_token_counts(server: RemoteServer) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        stream = await client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=f"Story number {i}:",
            max_tokens=16,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    async def main() -> list[int]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(main()) == [16] * 32


def _metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^treadle:{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert m, f"metric {name} missing"
    return float(m.group(1))


def test_a_client_that_disconnects_frees_its_kv_blocks(server: RemoteServer) -> None:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": PROMPT,
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()  # kept open: leaving this loop early would close the stream
        chunks = 0
        while chunks < 3:
            if next(lines).startswith("data:"):
                chunks += 1
        assert _metric(server, "num_requests_running") == 1
        assert _metric(server, "kv_cache_usage_perc") > 0
    # The connection is closed here: the server must abort the request and free its blocks.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (
            _metric(server, "num_requests_running") == 0
            and _metric(server, "kv_cache_usage_perc") == 0
        ):
            break
        time.sleep(0.2)
    assert _metric(server, "num_requests_running") == 0
    assert _metric(server, "kv_cache_usage_perc") == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, 400, None),
        ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, 400, None),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, None),
        ("/v1/completions", {"prompt": "word " * 600}, 400, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "model": "no-such-model"}, 404, "model"),
        ("/v1/chat/completions", {"messages": "not a list"}, 400, None),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10_000}, 400, "max_tokens"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    server: RemoteServer,
    client: openai.OpenAI,
    path: str,
    body: dict,
    status: int,
    param: str | None,  # type: ignore[type-arg]
) -> None:
    resp = httpx.post(server.url + path, json=body, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    if param:
        assert error["param"] == param
    ok = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=3, temperature=0
    )
    assert len(ok.choices[0].text) > 0


def test_malformed_json_is_a_400(server: RemoteServer) -> None:
    resp = httpx.post(
        server.url + "/v1/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "BadRequestError"


def test_models_tokenize_detokenize_version_metrics(server: RemoteServer) -> None:
    models = httpx.get(server.url + "/v1/models").json()
    assert (
        models["data"][0]["id"] == "SmolLM2-135M-Instruct"
        and models["data"][0]["max_model_len"] == 512
        and models["data"][0]["root"] == "SmolLM2-135M-Instruct"  # never a filesystem path
    )
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["count"] == 5
    assert (
        httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        == PROMPT
    )
    assert "version" in httpx.get(server.url + "/version").json()
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "generation_tokens_total",
        "prefix_cache_queries_total",
    ):
        assert f"treadle:{name}" in text
    assert 'model_name="SmolLM2-135M-Instruct"' in text and 'engine="0"' in text


def test_llamacpp_props_and_apply_template(server: RemoteServer) -> None:
    """llama.cpp's /props and /apply-template, with its field names (issue 26 item 5)."""
    from treadle.config import resolve_model
    from treadle.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None))
    props = httpx.get(server.url + "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 512
    assert props["default_generation_settings"]["params"]["n_predict"] == -1
    assert props["total_slots"] == 256  # --max-num-seqs
    assert props["chat_template"] == tokenizer.chat_template
    assert (props["bos_token"], props["eos_token"]) == (tokenizer.bos_token, tokenizer.eos_token)
    assert props["model_path"] == props["model_alias"] == "SmolLM2-135M-Instruct"  # no path
    assert props["build_info"].startswith("treadle ")
    assert props["modalities"] == {"vision": False, "audio": False}

    messages = [{"role": "system", "content": "Be brief."}, *CHAT]
    resp = httpx.post(server.url + "/apply-template", json={"messages": messages})
    assert resp.status_code == 200, resp.text
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert resp.json() == {"prompt": expected}
    for body, param in (
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
    ):
        bad = httpx.post(server.url + "/apply-template", json=body)
        assert bad.status_code == 400, (body, bad.text)
        assert param in json.dumps(bad.json()["error"]), bad.text


def test_llamacpp_infill_needs_fim_tokens_and_completion_serves(server: RemoteServer) -> None:
    """The default model has no FIM tokens: /infill is a 400 naming them; llama.cpp's
    /completion answers with its fields, the same greedy text as /v1/completions."""
    body = {"input_prefix": "def f():", "input_suffix": "", "n_predict": 4}
    resp = httpx.post(server.url + "/infill", json=body)
    assert resp.status_code == 400, resp.text
    assert "<|fim_prefix|>" in resp.json()["error"]["message"]
    resp = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "suffix": "b"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "suffix", resp.text
    body = {"prompt": "The capital of France is", "n_predict": 5, "temperature": 0}
    resp = httpx.post(server.url + "/completion", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["stop"] is True and out["tokens_predicted"] == len(out["tokens"]) <= 5
    v1 = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0},
    ).json()
    assert out["content"] == v1["choices"][0]["text"]


# -- lifecycle: separate small servers on the tiny model -------------------------------------------


def test_api_key_is_required_when_set(server_factory, tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    srv = server_factory([str(tiny_model_factory("llama")), "--api-key", "s3cret"])
    body = {"prompt": "hi", "max_tokens": 2}
    missing = httpx.post(srv.url + "/v1/completions", json=body)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == 401
    ok = httpx.post(
        srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}
    )
    assert ok.status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200  # health needs no key
    # llama.cpp's /props and /apply-template need the key, as llama-server's do.
    assert httpx.get(srv.url + "/props").status_code == 401
    assert httpx.post(srv.url + "/apply-template", json={"messages": []}).status_code == 401
    keyed = httpx.get(srv.url + "/props", headers={"Authorization": "Bearer s3cret"})
    assert keyed.status_code == 200 and keyed.json()["total_slots"] == 256


@pytest.mark.serial
def test_sigterm_exits_cleanly(server_factory, tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    srv = server_factory([str(tiny_model_factory("llama"))])
    pids = [p.pid for p in srv.family()]
    shm_before = set(os.listdir("/dev/shm"))
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0
    assert_no_leftovers(srv, pids)
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_engine_kill_fails_the_stream_and_the_server_exits(
    server_factory, tiny_model_factory
) -> None:  # type: ignore[no-untyped-def]
    """With --max-engine-restarts 0, vLLM's behaviour (tests/entrypoints/test_engine_restart.py
    has the default's)."""
    srv = server_factory([str(tiny_model_factory("llama")), "--max-engine-restarts", "0"])
    pids = [p.pid for p in srv.family()]
    engine = srv.pid_of("treadle::EngineCore_DP0")
    body = {"prompt": "hi", "max_tokens": 200, "stream": True, "ignore_eos": True}
    lines = []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 4:
                os.kill(engine, signal.SIGKILL)
                killed = time.monotonic()
                # /health must turn non-200 within a second (it answers from what the
                # server knows: it may take the process monitor a moment to see the death).
                while httpx.get(srv.url + "/health", timeout=1).status_code == 200:
                    assert time.monotonic() - killed < 1.0
                    time.sleep(0.02)
    events = [json.loads(line[5:]) for line in lines if line.startswith("data: {")]
    assert "error" in events[-1] and events[-1]["error"]["code"] == 503
    assert lines[-1] == "data: [DONE]"
    assert srv.proc.wait(30) != 0
    assert_no_leftovers(srv, pids)


def test_api_server_kill_makes_the_engine_exit(server_factory, tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    srv = server_factory([str(tiny_model_factory("llama"))])
    engine = srv.pid_of("treadle::EngineCore_DP0")
    srv.proc.kill()
    srv.proc.wait(10)
    proc = psutil.Process(engine)
    proc.wait(5)  # raises TimeoutExpired if the engine outlives its parent by 5 s


def test_a_model_that_fails_to_load_exits_with_its_error(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    srv = server_factory([str(bad)], wait=False)
    assert srv.proc.wait(120) != 0
    assert "GPT2LMHeadModel" in srv.output()


@pytest.mark.serial
def test_serve_tp4_runs_six_processes_and_a_dead_worker_takes_it_down(
    server_factory, tiny_model_factory
) -> None:  # type: ignore[no-untyped-def]
    shm_before = {n for n in os.listdir("/dev/shm") if n.startswith("treadle")}
    srv = server_factory(
        [str(tiny_model_factory("llama")), "-tp", "4", "--max-engine-restarts", "0"]
    )
    workers = [f"treadle::Worker_TP{r}" for r in range(4)]
    assert treadle_titles(srv) == sorted(
        ["treadle::APIServer_0", "treadle::EngineCore_DP0", *workers]
    )
    ok = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    pids = [p.pid for p in srv.family()]
    os.kill(srv.pid_of("treadle::Worker_TP2"), signal.SIGKILL)
    deadline = time.monotonic() + 5
    status = 200
    while status == 200 and time.monotonic() < deadline:
        try:
            status = httpx.get(srv.url + "/health", timeout=1).status_code
        except httpx.HTTPError:
            status = 0
        time.sleep(0.1)
    assert status != 200
    assert srv.proc.wait(30) != 0
    assert_no_leftovers(srv, pids)
    assert {n for n in os.listdir("/dev/shm") if n.startswith("treadle")} <= shm_before
