"""Tool calling as a user meets it (issue 13): the real `openai` client against `treadle serve
--enable-auto-tool-choice --tool-call-parser hermes` on the default model. `required` and named
choices run under a grammar, so their arguments always validate against the function's
parameters; streams add up to the non-streamed message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from serve_helpers import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 32},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 32}},
    "required": ["timezone"],
    "additionalProperties": False,  # else a small model adds free-text fields at length
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    srv = RemoteServer(
        [
            "--max-model-len",
            "1024",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--trust-request-chat-template",
        ],
        tmp_path_factory.mktemp("tools"),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("seed", range(3))
def test_required_and_named_calls_validate_against_the_parameters(
    client: openai.OpenAI, seed: int
) -> None:
    for choice, names in (
        ("required", set(PARAMETERS)),
        ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ):
        out = client.chat.completions.create(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            tools=TOOLS,
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=200,
            temperature=0.7,
            seed=seed,
        )
        message = out.choices[0].message
        # "required" lets the model add calls until max_tokens cut the array ("length"
        # stays, as the output was cut); every complete call still parses and validates
        reasons = ("tool_calls", "length") if choice == "required" else ("tool_calls",)
        assert out.choices[0].finish_reason in reasons, message
        calls = message.tool_calls or []
        cut = out.choices[0].finish_reason == "length"
        if not cut:
            assert message.content is None
        elif message.content is None:  # cut inside the last call's arguments: it is kept
            calls = calls[:-1]
        if calls or not cut:
            _check_calls(calls, names)
        if choice != "required":
            assert len(message.tool_calls or []) == 1


def test_a_streamed_call_adds_up_to_the_message(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 200,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**fields).choices[0]
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
                if piece.function and piece.function.name:
                    call["name"] = piece.function.name
                if piece.function and piece.function.arguments:
                    call["arguments"] += piece.function.arguments
    assert [r for r in reasons if r] == ["tool_calls"]
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []] == [
        (calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)
    ]


# SmolLM2's own template ignores `tools`; this one writes their names before the messages.
NAMES_TEMPLATE = (
    "{% for t in tools or [] %}tool {{ t.function.name }}\n{% endfor %}"
    "{% for m in messages %}{{ m.content }}\n{% endfor %}"
)


def test_tools_reach_the_chat_template_and_none_keeps_plain_text(client: openai.OpenAI) -> None:
    def prompt_tokens(**fields: Any) -> int:
        out = client.chat.completions.create(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
            extra_body={"chat_template": NAMES_TEMPLATE},
            **fields,
        )
        assert out.choices[0].message.tool_calls is None
        assert out.choices[0].finish_reason == "length" and out.usage is not None
        return out.usage.prompt_tokens

    bare = prompt_tokens()
    with_tools = prompt_tokens(tools=TOOLS, tool_choice="none")
    one_tool = prompt_tokens(tools=TOOLS[:1], tool_choice="none")
    assert bare < one_tool < with_tools


def test_auto_answers_with_a_message_or_calls_that_parse(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0
    )  # type: ignore[arg-type]
    message = out.choices[0].message
    if message.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            assert call.function.name in PARAMETERS
            assert isinstance(json.loads(call.function.arguments), dict)
    else:
        assert message.content and "<tool_call>" not in message.content


def test_parallel_tool_calls_false_keeps_one_call(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Paris, Rome and Oslo?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 300,
        "temperature": 0,
    }
    for stream in (False, True):
        if stream:
            indexes = {
                piece.index
                for chunk in client.chat.completions.create(
                    **fields, parallel_tool_calls=False, stream=True
                )
                for choice in chunk.choices
                for piece in choice.delta.tool_calls or []
            }
            assert indexes == {0}
        else:
            out = client.chat.completions.create(**fields, parallel_tool_calls=False)
            assert len(out.choices[0].message.tool_calls or []) == 1
            assert out.choices[0].finish_reason == "tool_calls"  # the grammar allows one


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    server: RemoteServer, body: dict[str, Any], param: str
) -> None:
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body},
        timeout=60,
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_auto_without_a_parser_is_vllm_s_400(server_factory) -> None:  # type: ignore[no-untyped-def]
    plain = server_factory(["--max-model-len", "512"])
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "auto"}
    resp = httpx.post(plain.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400 and "--enable-auto-tool-choice" in resp.text
    # without tool_choice, tools only reach the template ("none"), as with no parser in vLLM's
    # older releases; the answer is plain text
    del body["tool_choice"]
    out = httpx.post(
        plain.url + "/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=60
    ).json()
    assert "tool_calls" not in out["choices"][0]["message"]


def _streamed(client: openai.OpenAI, **fields: Any) -> tuple[str, dict[int, list[str]], list[Any]]:
    """(content, each call's argument deltas, finish reasons) of a stream."""
    content, arguments, reasons = "", {}, []
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                deltas = arguments.setdefault(piece.index, [])
                if piece.function and piece.function.arguments:
                    deltas.append(piece.function.arguments)
    return content, arguments, [r for r in reasons if r]


@pytest.mark.parametrize("max_tokens", [3, 7])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_cut_short_keeps_what_was_generated(
    client: openai.OpenAI, max_tokens: int, choice: Any
) -> None:
    """Issue 28: `required` with too few tokens answered content null and no tool_calls. Now
    the text that became no call is the content, a call begun keeps its arguments so far,
    finish_reason stays "length", and the stream says the same."""
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": choice,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    out = client.chat.completions.create(**fields).choices[0]
    assert out.finish_reason == "length"
    message = out.message
    calls = message.tool_calls or []
    generated = (message.content or "") + "".join(c.function.arguments for c in calls)
    assert generated.strip(), message
    content, arguments, reasons = _streamed(client, **fields)
    assert reasons == ["length"]
    assert content == (message.content or "")
    assert ["".join(arguments[i]) for i in sorted(arguments)] == [
        c.function.arguments for c in calls
    ]


def test_required_streams_arguments_as_they_are_generated(client: openai.OpenAI) -> None:
    """Issue 28: a streamed "required" sent no argument deltas until the whole array was
    parsed; now, as the named choice, the arguments come in pieces as the model writes them."""
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS[:1],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 200,
        "temperature": 0,
    }
    _, arguments, reasons = _streamed(client, **fields)
    assert reasons == ["tool_calls"]
    assert len(arguments[0]) > 3, arguments  # many pieces, not one at the end
    jsonschema.validate(json.loads("".join(arguments[0])), WEATHER)
