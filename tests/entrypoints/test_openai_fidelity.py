"""OpenAI API fidelity (issue 13) on a live `treadle serve` of the default model: the request
fields of OpenAI and vLLM, logprobs in their shapes (lm-eval's loglikelihood requests too),
echo, prompt truncation, chat messages, n > 1 streams, refused and ignored fields, and the
models routes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from serve_helpers import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
CMPL, CHATS = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    srv = RemoteServer(["--max-model-len", "512"], tmp_path_factory.mktemp("fidelity"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def _post(server: RemoteServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def _error(server: RemoteServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(server.url + path, json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    return error


def _ids(server: RemoteServer, text: str) -> list[int]:
    ids: list[int] = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    return ids


def _events(server: RemoteServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a stream, checking it ends with [DONE]."""
    with httpx.stream(
        "POST", server.url + path, json={"model": MODEL, **body}, timeout=120
    ) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def _token_ids(tokens: list[str]) -> list[int]:
    """Token ids from `return_tokens_as_token_ids` tokens ("token_id:123")."""
    return [int(t.removeprefix("token_id:")) for t in tokens]


# -- logprobs ----------------------------------------------------------------------------------


def test_completion_logprobs_0_and_k(client: openai.OpenAI) -> None:
    """logprobs=0: the chosen token alone in top_logprobs; logprobs=k: the top k, plus the
    chosen token when it is not among them (vLLM's shape); offsets follow the token texts."""
    zero = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0
    ).choices[0]
    lp = zero.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == zero.text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value is not None and value <= 0 and top == {token: value}
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]

    sampled = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=2.0,
        seed=3,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},  # keys that cannot collide
    ).choices[0]
    lp = sampled.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    outside = 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value
        others = sorted((v for t, v in top.items() if t != token), reverse=True)
        if len(top) == 3:  # the chosen token is not in the top 2: both others beat it
            outside += 1
            assert len(others) == 2 and min(others) >= value
        else:
            assert len(top) == 2
    assert outside > 0, "temperature 2 was expected to choose some token outside the top 2"


def test_chat_top_logprobs_are_exactly_k_in_rank_order(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )  # type: ignore[call-overload]
    content = out.choices[0].logprobs.content
    assert content and len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert item.top_logprobs[0].token == item.token  # greedy picks rank 1
        assert item.top_logprobs[0].logprob == item.logprob
        for t in [item, *item.top_logprobs]:
            assert t.bytes == list(t.token.encode())

    plain = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True
    )  # type: ignore[call-overload]
    content = plain.choices[0].logprobs.content
    assert content and all(item.top_logprobs == [] and item.logprob <= 0 for item in content)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CMPL, {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        (CMPL, {"prompt": PROMPT, "logprobs": 21, "echo": True}, "logprobs"),
        (CMPL, {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
        (CHATS, {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHATS, {"messages": CHAT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_max_logprobs_bounds_every_logprobs_field(
    server: RemoteServer, path: str, body: dict[str, Any], param: str
) -> None:
    error = _error(server, path, body)
    assert error["param"] == param and "--max-logprobs" in error["message"]


def test_max_logprobs_itself_is_accepted(server: RemoteServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "logprobs": 20, "temperature": 0}
    out = _post(server, CMPL, {**body, "return_tokens_as_token_ids": True})
    for top in out["choices"][0]["logprobs"]["top_logprobs"]:
        assert len(top) == 20  # greedy: the chosen token is among the top 20


# -- echo, prompt logprobs, lm-eval ------------------------------------------------------------

LOGLIKELIHOOD = {"temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
"""What lm-eval's `local-completions` sends for loglikelihood requests (one token generated)."""


def test_echo_returns_logprobs_over_prompt_and_output(server: RemoteServer) -> None:
    """lm-eval's request shape: per prompt (token ids, batched) the prompt's tokens then the
    generated one; nothing scores the first prompt token."""
    prompts = [_ids(server, PROMPT + " Paris"), _ids(server, "Water boils at 100 degrees")]
    out = _post(server, CMPL, {"prompt": prompts, **LOGLIKELIHOOD})
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for ids, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 1
        assert len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][-1] is not None and lp["top_logprobs"][-1]
        prompt_text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()
        assert choice["text"].startswith(prompt_text["prompt"])
        assert lp["text_offset"][0] == 0
    assert out["usage"]["prompt_tokens"] == sum(len(ids) for ids in prompts)


def test_lm_eval_loglikelihood_scores_the_prompt(server: RemoteServer) -> None:
    """lm-eval reads `token_logprobs[ctxlen:-1]` and compares each with the best of its
    `top_logprobs`. The score of a greedy continuation token must equal the logprob the model
    gave it when it generated it, and be the best."""
    context = _ids(server, PROMPT)
    plain = {**LOGLIKELIHOOD, "echo": False, "return_tokens_as_token_ids": True}
    gen = _post(server, CMPL, {"prompt": context, **plain})["choices"][0]["logprobs"]
    (token_id,) = _token_ids(gen["tokens"])
    out = _post(server, CMPL, {"prompt": [[*context, token_id]], **LOGLIKELIHOOD})
    lp = out["choices"][0]["logprobs"]
    ctxlen = len(context)
    scores, tops = lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]
    assert len(scores) == 1 and all(s is not None for s in lp["token_logprobs"][1:])
    assert scores[0] == pytest.approx(gen["token_logprobs"][0], abs=2e-3)
    assert scores[0] == max(tops[0].values())  # lm-eval's is_greedy
    for score, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert score in top.values() and len(top) <= 2


def test_echo_with_max_tokens_0_returns_the_prompt_alone(server: RemoteServer) -> None:
    ids = _ids(server, PROMPT)
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    choice = _post(server, CMPL, body)["choices"][0]
    assert choice["text"] == PROMPT
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["finish_reason"] == "length"

    events = _events(server, CMPL, {**body, "stream": True})
    chunks = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in chunks) == PROMPT
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == len(ids)
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length"]

    error = _error(server, CMPL, {"prompt": PROMPT, "max_tokens": 0})
    assert error["param"] == "max_tokens" and "echo" in error["message"]


def test_prompt_logprobs_have_one_entry_per_prompt_token(server: RemoteServer) -> None:
    ids = _ids(server, PROMPT)
    cmpl = _post(server, CMPL, {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    rows = cmpl["choices"][0]["prompt_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None
    chat = _post(server, CHATS, {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0})
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert chat["prompt_logprobs"][0] is None
    error = _error(server, CMPL, {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True})
    assert error["param"] == "prompt_logprobs"


def test_prompt_logprobs_score_each_prompt_token(server: RemoteServer) -> None:
    ids = _ids(server, PROMPT)
    rows = _post(server, CMPL, {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})["choices"][
        0
    ]["prompt_logprobs"]
    for token_id, row in zip(ids[1:], rows[1:], strict=True):
        assert row is not None and str(token_id) in row and 2 <= len(row) <= 3
        assert {1, 2} <= {entry["rank"] for entry in row.values()}  # the top 2 are there
        assert row[str(token_id)]["logprob"] <= 0


# -- request fields the engine must honour ------------------------------------------------------


def _greedy_ids(client: openai.OpenAI, **extra: Any) -> list[int]:
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True, **extra},
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None
    return _token_ids(lp.tokens)


def test_logit_bias_allowed_token_ids_and_bad_words_change_the_output(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    greedy = _greedy_ids(client)
    assert _greedy_ids(client, logit_bias={str(greedy[0]): -100})[0] != greedy[0]
    favourite = _ids(server, " London")[0]
    assert _greedy_ids(client, logit_bias={str(favourite): 100}) == [favourite] * 3
    allowed = _ids(server, " yes no")
    assert set(_greedy_ids(client, allowed_token_ids=allowed)) <= set(allowed)
    word = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    banned = word.choices[0].text.strip()
    assert banned
    text = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"bad_words": [banned]}
    )
    assert banned not in text.choices[0].text


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
CONSTRAINTS: list[tuple[str, dict[str, Any], Any]] = [
    ("structured_outputs.choice", {"structured_outputs": {"choice": ["red", "blue"]}}, "choice"),
    ("structured_outputs.regex", {"structured_outputs": {"regex": r" ?[0-9]{3}"}}, "regex"),
    ("structured_outputs.json", {"structured_outputs": {"json": SCHEMA}}, "schema"),
    (
        "structured_outputs.json text",
        {"structured_outputs": {"json": json.dumps(SCHEMA)}},
        "schema",
    ),
    ("response_format json_object", {"response_format": {"type": "json_object"}}, "object"),
    (
        "response_format json_schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA},
            }
        },
        "schema",
    ),
    ("guided_choice", {"guided_choice": ["red", "blue"]}, "choice"),
    ("guided_regex", {"guided_regex": r" ?[0-9]{3}"}, "regex"),
    ("guided_json", {"guided_json": SCHEMA}, "schema"),
]


@pytest.mark.parametrize(
    ("fields", "check"), [c[1:] for c in CONSTRAINTS], ids=[c[0] for c in CONSTRAINTS]
)
def test_output_constraints_hold(server: RemoteServer, fields: dict[str, Any], check: str) -> None:
    body = {"messages": CHAT, "max_tokens": 48, "temperature": 0, **fields}
    choice = _post(server, CHATS, body)["choices"][0]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", text
    if check == "choice":
        assert text in ("red", "blue")
    elif check == "regex":
        assert re.fullmatch(r" ?[0-9]{3}", text), text
    elif check == "object":
        assert isinstance(json.loads(text), dict)
    else:
        assert json.loads(text)["answer"] in ("yes", "no")


def test_openai_client_response_format_and_request_fields_are_accepted(
    client: openai.OpenAI,
) -> None:
    """The openai client sends these as it does to OpenAI; vLLM's go in `extra_body`."""
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        logit_bias={"7": -100},
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
        },
        extra_body={"bad_words": ["zebra"], "prompt_logprobs": 1},
    )
    assert out.choices[0].message.content is not None


# -- prompt truncation --------------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(server: RemoteServer) -> None:
    long = "one two three four " * 150  # 600 tokens: more than the model's 512
    ids = _ids(server, long)
    assert len(ids) > 512
    assert _error(server, CMPL, {"prompt": long})["param"] == "prompt"
    base = {"prompt": long, "max_tokens": 2, "temperature": 0, "echo": True}
    out = _post(server, CMPL, {**base, "truncate_prompt_tokens": 10})
    assert out["usage"]["prompt_tokens"] == 10
    tail = httpx.post(server.url + "/detokenize", json={"tokens": ids[-10:]}).json()["prompt"]
    assert out["choices"][0]["text"].startswith(tail)
    right = _post(server, CMPL, {**base, "truncate_prompt_tokens": 10, "truncation_side": "right"})
    head = httpx.post(server.url + "/detokenize", json={"tokens": ids[:10]}).json()["prompt"]
    assert right["choices"][0]["text"].startswith(head)
    most = _post(server, CMPL, {**base, "truncate_prompt_tokens": -1, "max_tokens": 1})
    assert most["usage"]["prompt_tokens"] == 511  # all the model takes, with room for one
    chat = [{"role": "user", "content": long}]
    out = _post(server, CHATS, {"messages": chat, "max_tokens": 1, "truncate_prompt_tokens": 20})
    assert out["usage"]["prompt_tokens"] == 20
    for k in (0, 512, -2):
        error = _error(server, CMPL, {"prompt": long, "truncate_prompt_tokens": k})
        assert error["param"] == "truncate_prompt_tokens"


# -- messages ------------------------------------------------------------------------------------


def test_developer_tool_calls_and_tool_messages_reach_the_template_as_given(
    server: RemoteServer,
) -> None:
    from treadle.config import resolve_model
    from treadle.tokenizer import load_tokenizer

    messages = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    out = _post(server, CHATS, {"messages": messages, "max_tokens": 2})
    tokenizer = load_tokenizer(resolve_model(None))
    rendered = [
        {**m, "content": "Weather?" if i == 1 else m["content"] or ""}
        for i, m in enumerate(messages)
    ]
    text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>developer\nAnswer briefly." in text  # vLLM passes the role through
    assert out["usage"]["prompt_tokens"] == len(tokenizer(text, add_special_tokens=False).input_ids)


# -- streams --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CMPL, CHATS])
def test_n_streams_send_each_choice_s_end_once_and_usage_once(
    server: RemoteServer, path: str
) -> None:
    body: dict[str, Any] = {
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 5,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    body.update({"prompt": PROMPT} if path == CMPL else {"messages": CHAT})
    events = _events(server, path, body)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    assert all(e["choices"] for e in chunks), "usage is sent once, at the end"
    ends: dict[int, int] = {}
    used: dict[int, int] = {}
    for event in chunks:
        (choice,) = event["choices"]
        index = choice["index"]
        assert index not in ends, f"choice {index} sent after its end: {choice}"
        assert event["usage"]["completion_tokens"] >= used.get(index, 0)
        used[index] = event["usage"]["completion_tokens"]
        if choice["finish_reason"] is not None:
            ends[index] = ends.get(index, 0) + 1
    assert ends == {0: 1, 1: 1, 2: 1}
    assert sum(used.values()) == last["usage"]["completion_tokens"]


# -- fields refused, accepted as unused, ignored --------------------------------------------------


def test_unused_values_of_unsupported_fields_are_accepted(server: RemoteServer) -> None:
    unused = {"best_of": 1, "suffix": None, "use_beam_search": False, "logits_processors": None}
    _post(server, CMPL, {"prompt": PROMPT, "max_tokens": 1, **unused})
    chat_unused = {"modalities": ["text"], "functions": [], "audio": None, "echo": False}
    _post(server, CHATS, {"messages": CHAT, "max_tokens": 1, **chat_unused})


def test_ignored_fields_are_named_in_one_warning_and_guided_fields_warn_once(
    server: RemoteServer,
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "frobnicate_me": 1, "stream": True}
    _events(server, CMPL, {**body, "stream_options": {"include_usage": True, "tweak_me": 2}})
    log = server.output()
    lines = [line for line in log.splitlines() if "frobnicate_me" in line]
    assert len(lines) == 1, lines
    assert "ignored" in lines[0] and "stream_options.tweak_me" in lines[0]
    for _ in range(2):
        _post(server, CMPL, {"prompt": PROMPT, "max_tokens": 1, "guided_regex": "a"})
    assert server.output().count("guided_regex is deprecated") == 1


# -- models ---------------------------------------------------------------------------------------


def test_models_routes(server: RemoteServer, client: openai.OpenAI) -> None:
    listed = httpx.get(server.url + "/v1/models").json()["data"]
    card = httpx.get(server.url + f"/v1/models/{MODEL}").json()
    assert [c["id"] for c in listed] == [MODEL] and card["id"] == MODEL
    assert card["root"] == MODEL and card["parent"] is None and card["max_model_len"] == 512
    assert card["permission"][0]["object"] == "model_permission"
    assert "/" not in json.dumps(listed) and "/" not in json.dumps(card)  # no file path
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")
    missing = httpx.get(server.url + "/v1/models/org/another-model")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"


# -- issue 28: integers in headers, stream shapes, prompt_logprobs, return_token_ids -------------


def _raw_post(server: RemoteServer, path: str, body: dict[str, Any], header: bytes) -> Any:
    """POST with an `X-data-parallel-rank` header sent byte for byte (httpx refuses some)."""
    import http.client

    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.putrequest("POST", path)
        data = json.dumps({"model": MODEL, **body}).encode()
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(data)))
        conn.putheader("X-data-parallel-rank", header)
        conn.endheaders(data)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize(
    "value",
    ["²", "٣", "1e3", " 1", "-0", "99999999999999999999", "1", "+0", "0 0"],
)
def test_rank_header_that_is_no_rank_is_a_400_never_a_500(server: RemoteServer, value: str) -> None:
    status, body = _raw_post(
        server, CMPL, {"prompt": PROMPT, "max_tokens": 1}, value.encode("utf-8")
    )
    assert status == 400, body
    assert body["error"]["type"] == "BadRequestError"
    assert body["error"]["param"] == "X-data-parallel-rank"


def test_rank_header_in_latin_1_and_a_real_rank(server: RemoteServer) -> None:
    # "²" as one latin-1 byte, which is how the server decodes a header (str.isdigit() is true)
    status, body = _raw_post(
        server, CMPL, {"prompt": PROMPT, "max_tokens": 1}, "²".encode("latin-1")
    )
    assert status == 400, body
    status, body = _raw_post(server, CMPL, {"prompt": PROMPT, "max_tokens": 1}, b"0")
    assert status == 200 and body["choices"][0]["text"] is not None


@pytest.mark.parametrize("key", ["٣", "²", "1e3", " 1", "-0"])
def test_logit_bias_keys_are_ascii_token_ids(server: RemoteServer, key: str) -> None:
    error = _error(server, CMPL, {"model": MODEL, "prompt": PROMPT, "logit_bias": {key: 5}})
    assert error["param"] == "logit_bias"


def test_n_completion_stream_sends_one_chunk_per_token_per_choice(server: RemoteServer) -> None:
    """vLLM's test_parallel_streaming: n=3, max_tokens=k gives k chunks per choice (issue 28:
    choices 1 and 2 began with an extra empty chunk), that add up to the text the same
    request gives whole. Fewer chunks are allowed: when the engine's steps come faster than
    the stream is written, the tokens of several steps go out in one chunk (as vLLM's
    output collector merges them), which a quiet machine does for this small model."""
    body = {"prompt": PROMPT, "max_tokens": 7, "n": 3, "ignore_eos": True, "seed": 3}
    events = _events(server, CMPL, {**body, "stream": True})
    chunks: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for event in events:
        (choice,) = event["choices"]
        chunks[choice["index"]].append(choice["text"])
    assert all(1 <= len(texts) <= 7 for texts in chunks.values()), chunks
    whole = httpx.post(server.url + CMPL, json={"model": MODEL, **body}, timeout=120).json()
    texts = {c["index"]: c["text"] for c in whole["choices"]}
    assert {i: "".join(t) for i, t in chunks.items()} == texts


def test_n_chat_stream_opens_with_a_role_chunk_per_choice(server: RemoteServer) -> None:
    """As vLLM: the first n chunks carry the role of choices 0..n-1, then one chunk per token
    per choice, the usage of a role chunk has no completion tokens and rises by one per
    token chunk."""
    body = {
        "messages": CHAT,
        "max_tokens": 6,
        "n": 3,
        "stream": True,
        "ignore_eos": True,
        "seed": 4,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    *events, last = _events(server, CHATS, body)
    for k, event in enumerate(events[:3]):
        (choice,) = event["choices"]
        assert choice == {
            "index": k,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        assert event["usage"]["completion_tokens"] == 0
    used = {0: 0, 1: 0, 2: 0}
    for event in events[3:]:
        (choice,) = event["choices"]
        assert "role" not in choice["delta"]
        used[choice["index"]] += 1
        assert event["usage"]["completion_tokens"] == used[choice["index"]]
    assert used == {0: 6, 1: 6, 2: 6}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 18


@pytest.mark.parametrize("path", [CMPL, CHATS])
def test_continuous_usage_rises_with_every_chunk(client: openai.OpenAI, path: str) -> None:
    """vLLM's test_chat_completion_stream_options / test_completion_stream_options."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    if path == CHATS:
        stream: Any = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            max_completion_tokens=10,
            extra_body={"min_tokens": 10},
            temperature=0.0,
            stream=True,
            stream_options=options,  # type: ignore[arg-type]
        )
    else:
        stream = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=10,
            extra_body={"min_tokens": 10},
            temperature=0.0,
            stream=True,
            stream_options=options,  # type: ignore[arg-type]
        )
    last = 0
    for chunk in stream:
        usage = chunk.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        if path == CMPL:
            assert usage.completion_tokens > 0
        assert last == 0 or usage.completion_tokens > last or not chunk.choices
        last = usage.completion_tokens
    assert last == 10


def test_prompt_logprobs_is_null_when_not_asked_for(client: openai.OpenAI) -> None:
    """vLLM's test_single_completion and test_prompt_logprobs_chat read the attribute."""
    completion = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    assert completion.choices[0].prompt_logprobs is None  # type: ignore[attr-defined]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert chat.prompt_logprobs is None  # type: ignore[attr-defined]
    asked = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"prompt_logprobs": 1},
    )
    assert len(asked.prompt_logprobs) > 3  # type: ignore[attr-defined]


def test_return_token_ids_in_responses(server: RemoteServer) -> None:
    """vLLM's `return_token_ids`: the prompt's ids and each choice's output ids."""
    ids = _ids(server, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "n": 2, "seed": 1}
    out = _post(server, CMPL, {**body, "return_token_ids": True})
    for choice in out["choices"]:
        assert choice["prompt_token_ids"] == ids
        assert len(choice["token_ids"]) == 5
    plain = _post(server, CMPL, body)["choices"][0]
    assert plain["prompt_token_ids"] is None and plain["token_ids"] is None  # as vLLM's

    chat = _post(server, CHATS, {"messages": CHAT, "max_tokens": 4, "return_token_ids": True})
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"] == 4
    plain = _post(server, CHATS, {"messages": CHAT, "max_tokens": 1})
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None


@pytest.mark.parametrize("path", [CMPL, CHATS])
def test_return_token_ids_in_streams(server: RemoteServer, path: str) -> None:
    """Placed as vLLM places them: completions put the prompt's ids in each choice's first
    chunk, chat at the top of each role chunk; every token chunk has its new ids."""
    body: dict[str, Any] = {"max_tokens": 5, "temperature": 0, "return_token_ids": True}
    body.update({"prompt": PROMPT} if path == CMPL else {"messages": CHAT})
    whole = _post(server, path, body)
    events = _events(server, path, {**body, "stream": True})
    if path == CMPL:
        first = events[0]["choices"][0]
        assert first["prompt_token_ids"] == whole["choices"][0]["prompt_token_ids"]
        assert all(e["choices"][0]["prompt_token_ids"] is None for e in events[1:])
    else:
        assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
        events = events[1:]
        assert all("prompt_token_ids" not in e for e in events)
    streamed = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert streamed == whole["choices"][0]["token_ids"]
    assert all(e["choices"][0]["token_ids"] for e in events)  # one chunk per token
