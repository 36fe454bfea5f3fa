"""The request side of tool calling: `tools` / `tool_choice` checked and planned once per
request (what reaches the chat template, the output a choice forces, the parser that reads
the output), the `finish_reason` a choice reports, and messages as chat templates want them.

Choices where vLLM leaves room (or where we differ):

- No `tool_choice`: "auto" when tools are given and the server has an auto parser, else
  "none" (tools still reach the template). vLLM answers 400 instead when it has no parser.
  An explicit "auto" without a parser is vLLM's 400. "required" or "auto" with `tools: []`
  act as "none" (vLLM, after OpenAI); a named choice needs its function in `tools`.
- With "none" the tools still reach the template unless `exclude_tools_when_none` (vLLM's
  `--exclude-tools-when-tool-choice-none`).
- `finish_reason` is "tool_calls" whenever a call was made and the engine said "stop", for
  auto, required and named alike. vLLM says "tool_calls" for all three when streaming but
  "stop" for required/named when not; one rule for both forms is what clients can rely on.
  "length" (and any other reason) is kept, so a client sees that the output was cut.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict

from treadle.entrypoints.openai.tool_calls.parsers import (
    NamedStream,
    ParsedOutput,
    PlainText,
    RequiredStream,
    ToolCallStream,
    get_tool_parser,
    loads_or_none,
)
from treadle.sampling_params import StructuredOutputsParams
from treadle.validation import InvalidRequest

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CHOICE_USAGE = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
_AUTO_NEEDS_PARSER = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    """`{"type": "function", "function": {"name": ...}}`; `type` may be left out (vLLM)."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

_TOOLS = pydantic.TypeAdapter(list[ToolDefinition])
_CHOICE: pydantic.TypeAdapter[ToolChoice] = pydantic.TypeAdapter(ToolChoice)


def finish_reason(engine_reason: str | None, tool_calls: int) -> str | None:
    """The `finish_reason` to report: "tool_calls" for a choice that made calls and stopped
    normally; otherwise the engine's own ("length" stays "length")."""
    return "tool_calls" if tool_calls and engine_reason == "stop" else engine_reason


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools (see the package docstring, `tool_calls/__init__.py`)."""

    mode: Literal["none", "auto", "required", "named"]
    template_tools: list[dict[str, Any]] | None
    structured_outputs: StructuredOutputsParams | None = None
    function_name: str | None = None
    parser: Callable[[], ToolCallStream] = PlainText

    def stream(self) -> ToolCallStream:
        return self.parser()

    def parse(self, text: str) -> ParsedOutput:
        return self.parser().parse(text)


def plan_tools(
    tools: Sequence[ToolDefinition | dict[str, Any]] | None,
    tool_choice: str | NamedToolChoice | dict[str, Any] | None,
    *,
    auto_parser: str | None,
    exclude_tools_when_none: bool = False,
    parallel_tool_calls: bool = True,
) -> ToolPlan:
    """Check `tools` with `tool_choice` and say what to do (see the module docstring).
    Without `parallel_tool_calls`, "required" forces exactly one call (the array's maxItems)."""
    checked = _check_tools(tools)
    choice = _check_choice(tool_choice)
    if choice is None:
        choice = "auto" if checked and auto_parser is not None else "none"
    if choice == "auto" and auto_parser is None:
        raise InvalidRequest("tool_choice", _AUTO_NEEDS_PARSER)
    if checked is None and choice != "none":
        raise InvalidRequest("tool_choice", "needs `tools`")
    if not checked and choice in ("auto", "required"):
        choice = "none"
    dicts = None if checked is None else [t.model_dump(exclude_unset=True) for t in checked]
    if choice == "none":
        return ToolPlan("none", None if exclude_tools_when_none else dicts)
    assert checked is not None and dicts is not None
    if choice == "auto":
        assert auto_parser is not None
        return ToolPlan("auto", dicts, parser=get_tool_parser(auto_parser))
    if choice == "required":
        return ToolPlan(
            "required",
            dicts,
            _structured(_required_schema(checked, parallel_tool_calls)),
            None,
            RequiredStream,
        )
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    function = next((t.function for t in checked if t.function.name == name), None)
    if function is None:
        raise InvalidRequest("tool_choice", f"names function {name!r}, which is not in `tools`")
    schema = _object_schema(function.parameters)
    return ToolPlan("named", dicts, _structured(schema), name, parser=lambda: NamedStream(name))


def _check_tools(
    tools: Sequence[ToolDefinition | dict[str, Any]] | None,
) -> list[ToolDefinition] | None:
    if tools is None:
        return None
    if isinstance(tools, list | tuple):
        tools = [t.model_dump(exclude_unset=True) if isinstance(t, BaseModel) else t for t in tools]
    try:
        checked = _TOOLS.validate_python(tools)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        raise InvalidRequest("tools", f"{where}: {error['msg']}") from None
    for i, tool in enumerate(checked):
        name, parameters = tool.function.name, tool.function.parameters
        if not _NAME.fullmatch(name):
            raise InvalidRequest(
                "tools",
                f"[{i}].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and - (got {name!r})",
            )
        if parameters is not None and parameters.get("type", "object") not in (
            "object",
            ["object"],
        ):
            raise InvalidRequest(
                "tools", f"[{i}].function.parameters must be a JSON schema of type object"
            )
    return checked


def _check_choice(tool_choice: str | NamedToolChoice | dict[str, Any] | None) -> ToolChoice | None:
    if tool_choice is None or isinstance(tool_choice, NamedToolChoice):
        return tool_choice
    try:
        return _CHOICE.validate_python(tool_choice)
    except pydantic.ValidationError:
        raise InvalidRequest("tool_choice", f"must be {_CHOICE_USAGE}") from None


def _object_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters as a schema whose instances are objects (as OpenAI requires)."""
    if parameters is None:
        return {"type": "object", "properties": {}}
    return {"type": "object", **parameters}


def _required_schema(tools: list[ToolDefinition], parallel: bool = True) -> dict[str, Any]:
    """A JSON array (at least one item; exactly one unless `parallel`) of `{"name": <a tool>,
    "parameters": <its schema>}`.
    Each tool's `$defs` / `definitions` move to the root, where its `#/...` refs now point."""
    shared: dict[str, dict[str, Any]] = {}
    options = []
    for tool in tools:
        parameters = _object_schema(tool.function.parameters)
        for key in ("$defs", "definitions"):
            defs = parameters.pop(key, None) or {}
            for def_name, schema in defs.items() if isinstance(defs, dict) else ():
                if shared.setdefault(key, {}).setdefault(def_name, schema) != schema:
                    raise InvalidRequest(
                        "tools", f"define {key} {def_name!r} differently (they share one schema)"
                    )
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    most = {} if parallel else {"maxItems": 1}
    return {"type": "array", "minItems": 1, **most, "items": {"anyOf": options}, **shared}


def _structured(schema: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except InvalidRequest as e:
        raise e.renamed({"structured_outputs.json": "tools"}) from None


def template_messages(messages: list[Any]) -> list[Any]:
    """Messages for the chat template: an assistant message's `tool_calls[].function.arguments`
    given as a JSON string of an object becomes that object (templates index into it, and
    vLLM does the same); everything else, `role: "tool"` messages included, is unchanged.
    Never raises and never changes `messages`: odd entries pass through as they are."""
    return [_template_message(m) for m in messages]


def _template_message(message: Any) -> Any:
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return message
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    return {**message, "tool_calls": [_template_call(c) for c in calls]}


def _template_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    arguments = loads_or_none(function["arguments"])
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}
