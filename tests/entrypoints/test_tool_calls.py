"""Tool calling: request checks, the forced-output schemas, the output parsers (whole and
streamed in any chunking) and the messages handed to chat templates."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import jsonschema_rs
import pytest

from treadle.entrypoints.openai.tool_calls import (
    TOOL_PARSERS,
    FunctionDefinition,
    HermesStream,
    NamedStream,
    ParsedOutput,
    RequiredStream,
    ToolCallStream,
    ToolDefinition,
    collect,
    finish_reason,
    get_tool_parser,
    plan_tools,
    template_messages,
)
from treadle.validation import InvalidRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, PING]


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


# --- plan_tools ------------------------------------------------------------------------------


def test_tools_default_to_auto_when_the_server_has_a_parser() -> None:
    plan = plan_tools(TOOLS, None, auto_parser="hermes")
    assert plan.mode == "auto"
    assert plan.template_tools == TOOLS
    assert plan.structured_outputs is None
    assert isinstance(plan.stream(), HermesStream)


def test_tools_default_to_none_without_a_parser_but_still_reach_the_template() -> None:
    plan = plan_tools(TOOLS, None, auto_parser=None)
    assert plan.mode == "none"
    assert plan.template_tools == TOOLS
    assert plan.structured_outputs is None
    text = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    assert plan.parse(text) == ParsedOutput(text, [])
    assert collect(plan.stream().feed(text)) == ParsedOutput(text, [])


def test_none_drops_the_tools_from_the_template_only_when_asked() -> None:
    assert plan_tools(TOOLS, "none", auto_parser="hermes").template_tools == TOOLS
    plan = plan_tools(TOOLS, "none", auto_parser="hermes", exclude_tools_when_none=True)
    assert (plan.mode, plan.template_tools) == ("none", None)


def test_no_tools_and_no_choice_is_plain_chat() -> None:
    plan = plan_tools(None, None, auto_parser="hermes")
    assert (plan.mode, plan.template_tools, plan.structured_outputs) == ("none", None, None)
    assert plan_tools(None, "none", auto_parser=None).mode == "none"


def test_template_tools_are_what_the_client_sent() -> None:
    tool = {"type": "function", "function": {"name": "f", "x-extra": 1}, "cache": True}
    plan = plan_tools([tool], None, auto_parser="hermes")
    assert plan.template_tools == [tool]  # no description/parameters: None, extras kept


def test_models_are_accepted_as_well_as_dicts() -> None:
    tool = ToolDefinition(type="function", function=FunctionDefinition(name="ping"))
    plan = plan_tools([tool], named("ping"), auto_parser=None)
    assert (plan.mode, plan.function_name) == ("named", "ping")
    assert plan.template_tools == [PING]


def test_auto_without_a_parser_is_refused_with_vllms_message() -> None:
    with pytest.raises(InvalidRequest) as e:
        plan_tools(TOOLS, "auto", auto_parser=None)
    assert e.value.param == "tool_choice"
    assert e.value.detail == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )


@pytest.mark.parametrize("choice", ["required", named("ping"), "auto"])
def test_a_tool_choice_needs_tools(choice: Any) -> None:
    with pytest.raises(InvalidRequest) as e:
        plan_tools(None, choice, auto_parser="hermes")
    assert e.value.param == "tool_choice"
    assert "needs `tools`" in e.value.detail


def test_a_named_choice_must_be_among_the_tools() -> None:
    with pytest.raises(InvalidRequest) as e:
        plan_tools(TOOLS, named("get_time"), auto_parser="hermes")
    assert e.value.param == "tool_choice"
    assert "'get_time'" in e.value.detail
    with pytest.raises(InvalidRequest) as e:
        plan_tools([], named("ping"), auto_parser="hermes")
    assert e.value.param == "tool_choice"


@pytest.mark.parametrize(
    "choice",
    ["always", "", 3, {"type": "function"}, {"function": {"name": 3}}, named("x") | {"type": "x"}],
)
def test_an_unknown_tool_choice_is_refused(choice: Any) -> None:
    with pytest.raises(InvalidRequest) as e:
        plan_tools(TOOLS, choice, auto_parser="hermes")
    assert e.value.param == "tool_choice"


def test_a_named_choice_may_leave_out_its_type() -> None:
    plan = plan_tools(TOOLS, {"function": {"name": "ping"}}, auto_parser=None)
    assert plan.function_name == "ping"


@pytest.mark.parametrize("choice", ["required", "auto", None])
def test_an_empty_tool_list_acts_as_none(choice: Any) -> None:
    plan = plan_tools([], choice, auto_parser="hermes")
    assert (plan.mode, plan.structured_outputs) == ("none", None)


@pytest.mark.parametrize("name", ["get weather", "", "a" * 65, "f\n", "fünf", "a.b"])
def test_function_names_follow_openais_pattern(name: str) -> None:
    tool = {"type": "function", "function": {"name": name}}
    with pytest.raises(InvalidRequest) as e:
        plan_tools([PING, tool], None, auto_parser="hermes")
    assert e.value.param == "tools"
    assert e.value.detail.startswith("[1].function.name")


def test_the_longest_name_is_accepted() -> None:
    name = "A-z_9" + "x" * 59
    assert plan_tools(
        [{"type": "function", "function": {"name": name}}], named(name), auto_parser=None
    )


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}},
        {"type": "function", "function": {"name": "f", "parameters": ["x"]}},
        {"type": "function", "function": {"name": "f", "parameters": "{}"}},
        {"type": "custom", "function": {"name": "f"}},
        {"function": {"name": "f"}},
        {"type": "function"},
        {"type": "function", "function": {"description": "no name"}},
        "get_weather",
    ],
)
def test_malformed_tools_are_refused(tool: Any) -> None:
    with pytest.raises(InvalidRequest) as e:
        plan_tools([tool], "none", auto_parser=None)
    assert e.value.param == "tools"


def test_tools_must_be_a_list() -> None:
    with pytest.raises(InvalidRequest) as e:
        plan_tools(WEATHER, None, auto_parser=None)
    assert e.value.param == "tools"


def test_an_unknown_server_parser_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="choose one of: hermes"):
        get_tool_parser("nope")
    assert get_tool_parser("hermes") is TOOL_PARSERS["hermes"]


# --- forced output ---------------------------------------------------------------------------


def required_validator(tools: list[Any]) -> Any:
    plan = plan_tools(tools, "required", auto_parser=None)
    assert plan.mode == "required" and plan.structured_outputs is not None
    schema = plan.structured_outputs.json
    assert isinstance(schema, dict)
    return jsonschema_rs.validator_for(schema)


def test_the_required_schema_accepts_calls_of_the_given_tools() -> None:
    v = required_validator(TOOLS)
    assert v.is_valid([{"name": "get_weather", "parameters": {"city": "Paris"}}])
    assert v.is_valid(
        [
            {"name": "ping", "parameters": {}},
            {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}},
        ]
    )


@pytest.mark.parametrize(
    "output",
    [
        [],
        {"name": "ping", "parameters": {}},
        [{"name": "get_time", "parameters": {}}],
        [{"name": "get_weather"}],
        [{"parameters": {"city": "Paris"}}],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "get_weather", "parameters": {"city": 3}}],
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "K"}}],
        [{"name": "ping", "parameters": {}, "why": "extra"}],
        [{"name": "ping", "parameters": []}],
        ["ping"],
    ],
)
def test_the_required_schema_refuses_anything_else(output: Any) -> None:
    assert not required_validator(TOOLS).is_valid(output)


def test_required_moves_each_tools_defs_to_the_root() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "paint",
            "parameters": {
                "type": "object",
                "properties": {"color": {"$ref": "#/$defs/Color"}},
                "required": ["color"],
                "$defs": {"Color": {"enum": ["red", "blue"]}},
            },
        },
    }
    before = copy.deepcopy(tool)
    v = required_validator([tool, PING])
    assert tool == before  # the client's schema is not changed
    assert v.is_valid([{"name": "paint", "parameters": {"color": "red"}}])
    assert not v.is_valid([{"name": "paint", "parameters": {"color": "green"}}])


def test_required_refuses_two_tools_that_define_one_name_differently() -> None:
    def tool(name: str, values: list[str]) -> dict[str, Any]:
        parameters = {"type": "object", "$defs": {"Color": {"enum": values}}}
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    plan_tools([tool("a", ["red"]), tool("b", ["red"])], "required", auto_parser=None)
    with pytest.raises(InvalidRequest) as e:
        plan_tools([tool("a", ["red"]), tool("b", ["blue"])], "required", auto_parser=None)
    assert e.value.param == "tools"


def test_a_named_choice_forces_that_functions_parameters() -> None:
    plan = plan_tools(TOOLS, named("get_weather"), auto_parser="hermes")
    assert plan.structured_outputs is not None
    schema = plan.structured_outputs.json
    assert isinstance(schema, dict)
    v = jsonschema_rs.validator_for(schema)
    assert v.is_valid({"city": "Paris"})
    assert not v.is_valid({"unit": "C"})
    assert not v.is_valid([{"city": "Paris"}])


def test_a_function_without_parameters_is_forced_to_an_object() -> None:
    plan = plan_tools(TOOLS, named("ping"), auto_parser=None)
    assert plan.structured_outputs is not None
    v = jsonschema_rs.validator_for(plan.structured_outputs.json)
    assert v.is_valid({}) and not v.is_valid("x") and not v.is_valid(3)


def test_a_schema_too_big_for_the_engine_is_refused_as_tools() -> None:
    huge = {"type": "object", "description": "x" * (1 << 20)}
    tool = {"type": "function", "function": {"name": "f", "parameters": huge}}
    with pytest.raises(InvalidRequest) as e:
        plan_tools([tool], "required", auto_parser=None)
    assert e.value.param == "tools"


# --- hermes ----------------------------------------------------------------------------------


def hermes(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def calls(parsed: ParsedOutput) -> list[tuple[str, Any]]:
    """(name, arguments as data) of each call, after checking the call's shape."""
    out = []
    for call in parsed.tool_calls:
        assert set(call) == {"id", "type", "function"}
        assert call["id"].startswith("chatcmpl-tool-") and len(call["id"]) == 46
        assert call["type"] == "function"
        assert set(call["function"]) == {"name", "arguments"}
        assert isinstance(call["function"]["arguments"], str)
        out.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
    return out


def test_hermes_one_call() -> None:
    parsed = HermesStream().parse(hermes("get_weather", {"city": "Paris"}))
    assert parsed.content is None
    assert calls(parsed) == [("get_weather", {"city": "Paris"})]
    assert parsed.tool_calls[0]["function"]["arguments"] == '{"city": "Paris"}'


def test_hermes_two_calls_in_order_with_their_own_ids() -> None:
    text = hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("ping", {})
    parsed = HermesStream().parse(text)
    assert parsed.content is None
    assert calls(parsed) == [("get_weather", {"city": "Paris"}), ("ping", {})]
    assert parsed.tool_calls[0]["id"] != parsed.tool_calls[1]["id"]


def test_hermes_text_around_calls_is_content() -> None:
    text = (
        "Let me look.\n" + hermes("ping", {}) + "\nAnd then " + hermes("ping", {"n": 1}) + " done"
    )
    parsed = HermesStream().parse(text)
    assert parsed.content == "Let me look.\n\nAnd then  done"
    assert calls(parsed) == [("ping", {}), ("ping", {"n": 1})]


def test_hermes_broken_json_stays_in_content() -> None:
    broken = '<tool_call>\n{"name": "ping", "arguments": {"n": 1}\n</tool_call>'
    text = "Before " + broken + " " + hermes("ping", {})
    parsed = HermesStream().parse(text)
    assert parsed.content == "Before " + broken + " "
    assert calls(parsed) == [("ping", {})]


@pytest.mark.parametrize(
    "body",
    [
        '{"arguments": {}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "", "arguments": {}}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "not json"}',
        '[{"name": "f", "arguments": {}}]',
        "",
        "[" * 100_000,
    ],
)
def test_hermes_blocks_that_are_not_calls_stay_in_content(body: str) -> None:
    text = f"<tool_call>{body}</tool_call>"
    assert HermesStream().parse(text) == ParsedOutput(text, [])


def test_hermes_without_calls_is_content_as_is() -> None:
    text = "No tools needed: 2 < 3 and <tool_c is not a tag.\n"
    assert HermesStream().parse(text) == ParsedOutput(text, [])


@pytest.mark.parametrize("text", ["", " ", "\n\n", " \n" + hermes("ping", {}) + "\n"])
def test_hermes_whitespace_only_content_is_none(text: str) -> None:
    assert HermesStream().parse(text).content is None


def test_hermes_accepts_arguments_as_a_json_string_and_parameters() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "b", "parameters": {"y": 2}}</tool_call>'
        '<tool_call>{"name": "c"}</tool_call>'
    )
    assert calls(HermesStream().parse(text)) == [("a", {"x": 1}), ("b", {"y": 2}), ("c", {})]


def test_hermes_keeps_non_ascii_arguments_readable() -> None:
    parsed = HermesStream().parse(hermes("get_weather", {"city": "Zürich"}))
    assert parsed.tool_calls[0]["function"]["arguments"] == '{"city": "Zürich"}'


def test_hermes_an_unterminated_block_is_a_call_only_if_its_json_is_whole() -> None:
    whole = '<tool_call>\n{"name": "ping", "arguments": {"n": 1}}\n'
    assert calls(HermesStream().parse("Hi " + whole)) == [("ping", {"n": 1})]
    assert HermesStream().parse("Hi " + whole).content == "Hi "
    cut = '<tool_call>\n{"name": "ping", "argu'
    assert HermesStream().parse("Hi " + cut) == ParsedOutput("Hi " + cut, [])


def test_hermes_a_start_tag_inside_a_block_breaks_that_block() -> None:
    text = "<tool_call> <tool_call>" + hermes("ping", {})[len("<tool_call>") :]
    parsed = HermesStream().parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


# --- streaming -------------------------------------------------------------------------------

HERMES_TEXTS = [
    hermes("get_weather", {"city": "Paris", "unit": "C"}),
    "Sure! " + hermes("get_weather", {"city": "Zürich"}) + "\n" + hermes("ping", {}) + "\n",
    "  \n" + hermes("ping", {"s": "</tool_call"}) + "  trailing <tool_",
    "Before <tool_call>{broken</tool_call> mid "
    + hermes("ping", {"a": [1, {"b": "}"}]})
    + " end <",
    '<tool_call><tool_call>{"name": "x"}</tool_call>',
    'Text then an open block <tool_call>{"name": "ping", "arguments": {}}',
    'Text then a cut block <tool_call>{"name": "ping", "argum',
    "just text, with < and <tool and </tool_call> alone",
    "",
    "   ",
]


def chunkings(text: str) -> list[list[str]]:
    """Whole, character by character, and random cuts (fixed seeds)."""
    out = [[text], list(text)]
    for seed in range(20 if len(text) > 1 else 0):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def run_stream(stream: ToolCallStream, pieces: list[str]) -> list[dict[str, Any]]:
    deltas = []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.finish()
    return deltas


def without_ids(parsed: ParsedOutput) -> ParsedOutput:
    return ParsedOutput(
        parsed.content, [{k: v for k, v in c.items() if k != "id"} for c in parsed.tool_calls]
    )


def check_delta_shapes(deltas: list[dict[str, Any]]) -> None:
    """A call's first delta names it (id, type, arguments ""); later ones add arguments only."""
    begun: set[int] = set()
    for delta in deltas:
        assert len(delta) == 1
        if "content" in delta:
            assert delta["content"]
            continue
        (piece,) = delta["tool_calls"]
        if piece["index"] in begun:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
        else:
            assert piece["index"] == len(begun)
            assert set(piece) == {"index", "id", "type", "function"}
            assert piece["function"]["arguments"] == ""
            begun.add(piece["index"])


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_streams_the_same_message_in_any_chunking(text: str) -> None:
    expected = without_ids(HermesStream().parse(text))
    for pieces in chunkings(text):
        stream = HermesStream()
        deltas = run_stream(stream, pieces)
        check_delta_shapes(deltas)
        assert without_ids(collect(deltas)) == expected, pieces
        assert stream.tool_calls == len(expected.tool_calls)


def test_hermes_holds_back_only_what_may_be_a_tag() -> None:
    stream = HermesStream()
    assert stream.feed("Hello <tool") == [{"content": "Hello "}]
    assert stream.feed("box> and <t") == [{"content": "<toolbox> and "}]
    assert stream.feed('ool_call>{"name": "ping"}') == []
    deltas = stream.feed("</tool_call>")
    assert [d["tool_calls"][0]["function"] for d in deltas] == [
        {"name": "ping", "arguments": ""},
        {"arguments": "{}"},
    ]
    assert stream.feed(" bye <tool_ca") == [{"content": " bye "}]
    assert stream.finish() == [{"content": "<tool_ca"}]


def test_hermes_holds_leading_whitespace_until_real_content() -> None:
    stream = HermesStream()
    assert stream.feed("\n \n") == []
    assert stream.feed(hermes("ping", {}))[0]["tool_calls"][0]["index"] == 0
    assert stream.feed("\n") == []
    assert stream.feed("ok") == [{"content": "\n \n\nok"}]
    assert stream.feed("\n") == [{"content": "\n"}]


def test_named_output_is_the_arguments_of_one_call() -> None:
    parsed = NamedStream("get_weather").parse(' \n{"city": "Paris"}\n ')
    assert calls(parsed) == [("get_weather", {"city": "Paris"})]
    assert parsed.tool_calls[0]["function"]["arguments"] == '{"city": "Paris"}'
    assert parsed.content is None


def test_named_streams_the_name_first_then_text_as_it_comes() -> None:
    stream = NamedStream("get_weather")
    (header,) = stream.feed("")
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert stream.feed('{"city": ') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}
    ]
    assert stream.feed(' "Paris"}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '  "Paris"}'}}]}  # the held space
    ]
    assert stream.feed("\n") == [] and stream.finish() == []
    assert stream.tool_calls == 1


def test_named_with_no_output_is_still_one_call() -> None:
    parsed = NamedStream("ping").parse("")
    assert [c["function"] for c in parsed.tool_calls] == [{"name": "ping", "arguments": ""}]


@pytest.mark.parametrize(
    "text", ['  {"a": [1, " x "], "b": {}}  \n', "{}", "", "\n\n", '{"cut": "of']
)
def test_named_streams_the_same_message_in_any_chunking(text: str) -> None:
    expected = without_ids(NamedStream("f").parse(text))
    for pieces in chunkings(text):
        deltas = run_stream(NamedStream("f"), pieces)
        check_delta_shapes(deltas)
        assert without_ids(collect(deltas)) == expected, pieces


REQUIRED_TEXT = json.dumps(
    [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "echo", "parameters": {"s": 'a}]\\"{[', "n": [1, [2, {"x": None}]]}},
        {"name": "ping", "parameters": {}},
    ]
)


def test_required_output_becomes_calls() -> None:
    parsed = RequiredStream().parse(REQUIRED_TEXT)
    assert parsed.content is None
    assert calls(parsed) == [
        ("get_weather", {"city": "Paris"}),
        ("echo", {"s": 'a}]\\"{[', "n": [1, [2, {"x": None}]]}),
        ("ping", {}),
    ]


def test_required_streams_arguments_as_they_are_generated() -> None:
    """As the named choice (and vLLM's "required"): the header once the name is whole and the
    parameters have begun, then the parameters' text as it comes, not the call at its end."""
    stream = RequiredStream()
    assert stream.feed('[{"name": "get_weather", "parameters": ') == []
    header, brace = stream.feed("{")
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert brace == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    assert stream.feed('"city": "Pa') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '"city": "Pa'}}]}
    ]
    assert stream.feed('ris"}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}
    ]
    assert stream.feed("}, ") == []
    assert stream.feed("]") == [] and stream.finish() == []


def test_required_parameters_before_the_name_make_a_call_when_the_element_closes() -> None:
    text = '[{"parameters": {"city": "Oslo"}, "name": "get_weather"}]'
    assert calls(RequiredStream().parse(text)) == [("get_weather", {"city": "Oslo"})]
    assert calls(RequiredStream().parse('[{"name": "ping"}]')) == [("ping", {})]


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ('[{"name": "get_wea', '[{"name": "get_wea', []),
        ("[", "[", []),
        ('[{"name": "ping", "parameters": {}}, {"name": "ech', '{"name": "ech', ["ping"]),
        ('[{"name": "ping", "parameters": {}},', None, ["ping"]),
        ('[{"name": "get_weather", "parameters": {"city": "Pa', None, ["get_weather"]),
    ],
)
def test_required_cut_short_keeps_what_was_generated(
    text: str, content: str | None, names: list[str]
) -> None:
    """max_tokens cut the array: a call begun keeps the arguments generated so far; text that
    became no call is the content (issue 28: it was dropped, leaving the client nothing)."""
    parsed = RequiredStream().parse(text)
    assert parsed.content == content
    assert [call["function"]["name"] for call in parsed.tool_calls] == names
    if names == ["get_weather"]:
        assert parsed.tool_calls[0]["function"]["arguments"] == '{"city": "Pa'


@pytest.mark.parametrize(
    "text",
    [
        REQUIRED_TEXT,
        "\n" + REQUIRED_TEXT + "\n trailing",
        REQUIRED_TEXT[: REQUIRED_TEXT.index('{"name": "ping"') + 12],  # cut: the last is content
        REQUIRED_TEXT[: REQUIRED_TEXT.index('"Paris"') + 3],  # cut inside the arguments
        '[{"name": "ping", "parameters": {}}, 3, {"name": "x", "parameters": []}, {"nam": 1}]',
        'not an array [{"name": "ping", "parameters": {}}]',
        "[]",
        "",
    ],
)
def test_required_streams_the_same_message_in_any_chunking(text: str) -> None:
    expected = without_ids(RequiredStream().parse(text))
    for pieces in chunkings(text):
        deltas = run_stream(RequiredStream(), pieces)
        check_delta_shapes(deltas)
        assert without_ids(collect(deltas)) == expected, pieces


def test_required_keeps_only_complete_well_formed_calls() -> None:
    cut = REQUIRED_TEXT[: REQUIRED_TEXT.index('{"name": "ping"') + 12]
    assert [name for name, _ in calls(RequiredStream().parse(cut))] == ["get_weather", "echo"]
    odd = '[{"name": "ping", "parameters": {}}, 3, {"name": "x", "parameters": []}, {"nam": 1}]'
    assert calls(RequiredStream().parse(odd)) == [("ping", {})]
    assert RequiredStream().parse('x [{"name": "ping", "parameters": {}}]').tool_calls == []


def test_plans_hand_out_a_fresh_stream_per_choice() -> None:
    plan = plan_tools(TOOLS, named("ping"), auto_parser=None)
    first, second = plan.stream(), plan.stream()
    assert first is not second and isinstance(first, NamedStream)
    first.feed("{}")
    assert second.tool_calls == 0
    assert calls(plan.parse("{}")) == [("ping", {})]
    assert isinstance(plan_tools(TOOLS, "required", auto_parser=None).stream(), RequiredStream)


# --- finish_reason and template messages ------------------------------------------------------


def test_finish_reason_says_tool_calls_only_when_calls_ended_normally() -> None:
    assert finish_reason("stop", 2) == "tool_calls"
    assert finish_reason("stop", 0) == "stop"
    assert finish_reason("length", 1) == "length"
    assert finish_reason(None, 1) is None


def test_template_messages_turn_arguments_into_objects() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "f", "arguments": "oops"},
                },
                {"id": "call_3", "type": "function", "function": {"name": "g", "arguments": "[1]"}},
                {"id": "call_4", "type": "function", "function": {"name": "h", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    before = copy.deepcopy(messages)
    out = template_messages(messages)
    assert messages == before
    assert out[0] == messages[0] and out[2] == messages[2]
    arguments = [c["function"]["arguments"] for c in out[1]["tool_calls"]]
    assert arguments == [{"city": "Paris"}, "oops", "[1]", {}]
    assert out[1]["tool_calls"][0]["id"] == "call_1"
    assert out[1]["content"] is None


@pytest.mark.parametrize(
    "message",
    [
        None,
        "text",
        {"role": "assistant"},
        {"role": "assistant", "tool_calls": None},
        {"role": "assistant", "tool_calls": "x"},
        {"role": "assistant", "tool_calls": [None, 3, {}, {"function": None}, {"function": {}}]},
        {"role": "user", "tool_calls": [{"function": {"arguments": "{}"}}]},
        {"content": "no role"},
    ],
)
def test_template_messages_pass_odd_messages_through(message: Any) -> None:
    assert template_messages([message]) == [message]
