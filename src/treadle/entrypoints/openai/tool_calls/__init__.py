"""Tool calling for the chat endpoint (OpenAI `tools` / `tool_choice`, with vLLM's behaviour):
which tools reach the chat template and what output is forced (`plan.py`, the request side),
and how output becomes `tool_calls` (`parsers.py`).

Wiring, in the order a request meets it:

- `plan = plan_tools(tools, tool_choice, auto_parser=..., exclude_tools_when_none=...)`:
  `tools` / `tool_choice` as they came (plain JSON, or the models in `plan.py`);
  `auto_parser` is `--tool-call-parser` when `--enable-auto-tool-choice` is set, else None.
  Raises `InvalidRequest` ("tools" or "tool_choice"). The plan says:
  - `plan.template_tools`: `tools=` for `apply_chat_template` (the tools as the client sent
    them), or None.
  - `plan.structured_outputs`: a `StructuredOutputsParams` the request must be run under
    (`required` and named), or None. The caller refuses a request that also sets its own
    `structured_outputs` / `response_format` (vLLM: "either ... or tools, not both").
  - `plan.parse(text) -> ParsedOutput(content, tool_calls)`: the final message.
  - `plan.stream() -> ToolCallStream`: one per choice; `feed(delta_text)` and, once,
    `finish()` return chat `delta` dicts (`{"content": ...}` or `{"tool_calls": [...]}`),
    each to be sent as its own chunk (`stream.tool_calls` counts the calls begun so far).
  - `plan.mode`: "none", "auto", "required" or "named" (`plan.function_name` for named).
- `finish_reason(engine_reason, tool_calls)`: the reason to report for a choice.
- `template_messages(messages)`: request messages as chat templates want them.
- `get_tool_parser(name)` / `TOOL_PARSERS`: the `--tool-call-parser` names ("hermes").
"""

from treadle.entrypoints.openai.tool_calls.parsers import (
    TOOL_PARSERS,
    Delta,
    HermesStream,
    NamedStream,
    ParsedOutput,
    PlainText,
    RequiredStream,
    ToolCallStream,
    collect,
    get_tool_parser,
)
from treadle.entrypoints.openai.tool_calls.plan import (
    FunctionDefinition,
    NamedToolChoice,
    ToolDefinition,
    ToolPlan,
    finish_reason,
    plan_tools,
    template_messages,
)

__all__ = [
    "TOOL_PARSERS",
    "Delta",
    "FunctionDefinition",
    "HermesStream",
    "NamedStream",
    "NamedToolChoice",
    "ParsedOutput",
    "PlainText",
    "RequiredStream",
    "ToolCallStream",
    "ToolDefinition",
    "ToolPlan",
    "collect",
    "finish_reason",
    "get_tool_parser",
    "plan_tools",
    "template_messages",
]
