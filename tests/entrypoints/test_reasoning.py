"""`reasoning.py`: `<think>...</think>` split from the answer as vLLM's deepseek_r1 and qwen3
parsers split it, whole and streamed in any pieces (the two forms always agree)."""

from __future__ import annotations

import pytest

from treadle.entrypoints.openai.reasoning import (
    ReasoningSplit,
    check_reasoning_parser,
    first_mode,
    split_reasoning,
)

CASES = [
    # (parser, prompt, output, (reasoning, content))
    ("qwen3", "", "<think>\nhmm</think>\n\nHi!", ("\nhmm", "\n\nHi!")),
    ("qwen3", "", "  <think>a</think>", ("a", None)),
    ("qwen3", "", "Hi! no </think> here", (None, "Hi! no </think> here")),
    ("qwen3", "", "<think>cut short", ("cut short", None)),
    ("qwen3", "", "<thi", (None, "<thi")),
    ("qwen3", "", "", (None, "")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "a</think>b", ("a", "b")),
    ("qwen3", "<think>\n\n</think>\n\n", "<think>x</think>y", (None, "<think>x</think>y")),
    ("deepseek_r1", "", "no start tag</think>answer", ("no start tag", "answer")),
    ("deepseek_r1", "", "<think>x</think>y</think>z", ("x", "y</think>z")),
    ("deepseek_r1", "", "still thinking", ("still thinking", None)),
    ("deepseek_r1", "", "a </thin", ("a </thin", None)),
    ("deepseek_r1", "", "</think>", (None, None)),
    ("deepseek_r1", "<think>x</think>", "plain", (None, "plain")),
]


@pytest.mark.parametrize(("parser", "prompt", "output", "expected"), CASES)
def test_split_whole_and_streamed_agree(parser, prompt, output, expected):
    mode = first_mode(parser, prompt, None)
    assert split_reasoning(mode, output) == expected
    # streamed in every 2- and 3-way cut, and character by character
    cuts = [[i] for i in range(len(output) + 1)]
    cuts += [[i, j] for i in range(len(output) + 1) for j in range(i, len(output) + 1)]
    for points in [*cuts, list(range(len(output) + 1))]:
        bounds = [0, *points, len(output)]
        pieces = [output[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        split = ReasoningSplit(mode)
        thought = content = ""
        for piece in pieces:
            r, c = split.feed(piece)
            thought, content = thought + r, content + c
        r, c = split.finish()
        thought, content = thought + r, content + c
        assert (thought or None) == expected[0], pieces
        assert content == (expected[1] or ""), pieces


def test_nothing_is_sent_that_could_still_be_a_tag():
    split = ReasoningSplit(first_mode("qwen3", "", None))
    assert split.feed("<th") == ("", "")
    assert split.feed("ink>I think</th") == ("I think", "")
    assert split.feed("ink>\n") == ("", "\n")
    assert split.feed("ok") == ("", "ok")


def test_enable_thinking_false_is_all_content_for_qwen3():
    assert first_mode("qwen3", "", {"enable_thinking": False}) == "content"
    assert first_mode("deepseek_r1", "", {"enable_thinking": False}) == "reasoning"


def test_unknown_parser_is_refused_naming_the_known_ones():
    check_reasoning_parser("qwen3")
    with pytest.raises(ValueError, match="deepseek_r1 and qwen3"):
        check_reasoning_parser("granite")


def test_serve_flags(default_model_path: str) -> None:
    """`--reasoning-parser NAME` reaches the front end's config; vLLM's old `--enable-reasoning`
    and an unknown name are refused, pointing at what to type."""
    from treadle.cli.main import build_parser
    from treadle.cli.serve import prepare

    def serve(*flags: str):  # type: ignore[no-untyped-def]
        return prepare(build_parser().parse_args(["serve", default_model_path, *flags]))

    config, _, _ = serve("--reasoning-parser", "deepseek_r1")
    assert config.frontend.reasoning_parser == "deepseek_r1"
    with pytest.raises(ValueError, match="use --reasoning-parser NAME"):
        serve("--enable-reasoning", "--reasoning-parser", "qwen3")
    with pytest.raises(ValueError, match="'granite' is not available"):
        serve("--reasoning-parser", "granite")


TOOL_OUTPUT = (
    '<think>call it?</think>\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
)


def _tool_chat(stream: bool = False):  # type: ignore[no-untyped-def]
    from treadle.entrypoints.openai.protocol import ChatCompletionRequest
    from treadle.entrypoints.openai.serving_chat import _Chat
    from treadle.entrypoints.openai.tool_calls import plan_tools

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "?"}], tools=tools, stream=stream
    )
    plan = plan_tools(tools, None, auto_parser="hermes")
    return _Chat(req, plan, [1], "chatcmpl-x", "m", None, first_mode("qwen3", "", None))  # type: ignore[arg-type]


def test_tool_calls_are_read_from_the_content_only() -> None:
    """As vLLM: the thinking is split off first, then the tool parser reads the rest (a
    `<tool_call>` inside the thinking is no call)."""
    from treadle.outputs import CompletionOutput, RequestOutput

    comp = CompletionOutput(0, TOOL_OUTPUT, [5] * 9, None, None, "stop")
    message = _tool_chat().body(RequestOutput("r", None, [1], [comp]))["choices"][0]["message"]
    assert message["reasoning_content"] == "call it?"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
    assert not (message["content"] or "").strip()
    thinking = TOOL_OUTPUT.replace("call it?</think>", "call <tool_call>{}</tool_call>?</think>")
    comp = CompletionOutput(0, thinking, [5] * 9, None, None, "stop")
    message = _tool_chat().body(RequestOutput("r", None, [1], [comp]))["choices"][0]["message"]
    assert message["reasoning_content"] == "call <tool_call>{}</tool_call>?"
    assert len(message["tool_calls"]) == 1

    job = _tool_chat(stream=True)
    choice = job._progress()
    deltas = []
    for n in range(1, len(TOOL_OUTPUT) + 1, 3):
        deltas += job._deltas(choice, TOOL_OUTPUT[n - 1 : n + 2], n + 2 >= len(TOOL_OUTPUT))[0]
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert thought == "call it?" and calls and calls[0]["function"]["name"] == "f"
