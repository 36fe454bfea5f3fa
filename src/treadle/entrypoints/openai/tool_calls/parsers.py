"""Tool call parsers: one choice's output text -> chat deltas (`{"content": ...}` or
`{"tool_calls": [...]}`), streamed in any chunking or whole, so that streamed and final
results agree by construction (`parse` is `feed(text) + finish()`).

- hermes (`--tool-call-parser hermes`, for `tool_choice: "auto"`): text outside
  `<tool_call>` blocks, in order, is `content` (vLLM keeps only the text before the first
  block); content that is only whitespace is None. A block whose JSON is not `{"name": str,
  "arguments": object}` (`"parameters"` accepted too, arguments may be a JSON string of an
  object) stays in `content`, tags included. A block still open when the text ends is a call
  if its JSON is whole (as vLLM's parser does), else content. Arguments are re-serialized
  (`json.dumps`, `ensure_ascii=False`, as vLLM). Streaming holds back a possible `<tool_call>`
  prefix, and leading whitespace until real content comes, and sends a call as its
  `</tool_call>` arrives: a header (id, name, arguments "") and the arguments in one piece.
- named: the output *is* the arguments; `arguments` is the text as generated, stripped of
  surrounding whitespace (so streamed fragments can be sent as they come). Always one call,
  with arguments "" when nothing was generated. The header is the first streamed delta.
- required: the output is the JSON array of the plan's schema; an element becomes a call once
  its name is whole and its parameters have begun, and the parameters' text is streamed as
  generated (as named; vLLM streams it so too), so `arguments` is that text as generated. An
  element not of the right shape is dropped. `content` is None, except when the output is cut
  short (`max_tokens`): the text that became no call yet is the content, and a call already
  begun keeps the arguments generated so far (finish_reason "length").
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Delta = dict[str, Any]
"""One `delta` of a chat completion chunk: `{"content": str}` or `{"tool_calls": [...]}`."""


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ParsedOutput:
    """A final message: `content` (None when there is none) and OpenAI `tool_calls` dicts
    `{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}`."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def collect(deltas: Sequence[Delta]) -> ParsedOutput:
    """The message that a stream of deltas adds up to (how a client assembles a stream)."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        content.append(delta.get("content") or "")
        for piece in delta.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
            for key in ("id", "type"):
                if key in piece:
                    call[key] = piece[key]
            function = piece.get("function", {})
            if "name" in function:
                call["function"]["name"] = function["name"]
            call["function"]["arguments"] += function.get("arguments", "")
    return ParsedOutput("".join(content) or None, [calls[i] for i in sorted(calls)])


class ToolCallStream(ABC):
    """Turns one choice's output text into chat deltas. Call `feed` with each new piece of
    text, then `finish` once; each returns the deltas that piece completes, in order. Not
    thread-safe; one per choice. `parse` does the same for a whole text at once."""

    def __init__(self) -> None:
        self.tool_calls = 0
        """Calls begun so far (a header was emitted for each)."""
        self._lead = ""  # whitespace-only content, held until real content arrives
        self._has_content = False

    @abstractmethod
    def feed(self, text: str) -> list[Delta]: ...

    @abstractmethod
    def finish(self) -> list[Delta]: ...

    def parse(self, text: str) -> ParsedOutput:
        return collect(self.feed(text) + self.finish())

    def _content(self, out: list[Delta], text: str) -> None:
        if not self._has_content:
            self._lead += text
            if self._lead.isspace() or not self._lead:
                return
            text, self._lead, self._has_content = self._lead, "", True
        if out and "content" in out[-1]:
            out[-1]["content"] += text
        elif text:
            out.append({"content": text})

    def _begin_call(self, out: list[Delta], name: str) -> int:
        index, self.tool_calls = self.tool_calls, self.tool_calls + 1
        function = {"name": name, "arguments": ""}
        call = {"index": index, "id": new_tool_call_id(), "type": "function", "function": function}
        out.append({"tool_calls": [call]})
        return index

    @staticmethod
    def _arguments(out: list[Delta], index: int, text: str) -> None:
        if text:
            out.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})


class PlainText(ToolCallStream):
    """No tool parsing ("none"): the text is the content, as it is."""

    def feed(self, text: str) -> list[Delta]:
        return [{"content": text}] if text else []

    def finish(self) -> list[Delta]:
        return []

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(text)


def loads_or_none(text: str) -> Any:
    """JSON, or None for text that is not (deep nesting included: never raise on output)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _dumps(value: Any) -> str | None:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None


class HermesStream(ToolCallStream):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks in free text
    (Hermes 2 Pro, Qwen2/2.5/3, SmolLM2 and many Llama fine-tunes)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # outside a block: a possible START prefix; inside: the block's body
        self._in_block = False
        self._searched = 0  # inside a block: END starts at or after this index of _buf

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self._buf += text
        while True:
            if not self._in_block:
                start = self._buf.find(self.START)
                if start < 0:
                    cut = len(self._buf) - _partial_suffix(self._buf, self.START)
                    self._content(out, self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                self._content(out, self._buf[:start])
                self._buf = self._buf[start + len(self.START) :]
                self._in_block, self._searched = True, 0
            else:
                end = self._buf.find(self.END, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._buf) - len(self.END) + 1)
                    return out
                self._block(out, self._buf[:end], self.END)
                self._buf = self._buf[end + len(self.END) :]
                self._in_block = False

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._in_block:
            self._block(out, self._buf, "")
        else:
            self._content(out, self._buf)
        self._buf, self._in_block = "", False
        return out

    def _block(self, out: list[Delta], body: str, end: str) -> None:
        call = _hermes_call(body)
        if call is None:
            self._content(out, self.START + body + end)
        else:
            self._arguments(out, self._begin_call(out, call[0]), call[1])


def _hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a hermes block's body, or None if it is not a call."""
    value = loads_or_none(body)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = loads_or_none(arguments)
    if not isinstance(arguments, dict):
        return None
    text = _dumps(arguments)
    return None if text is None else (value["name"], text)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class NamedStream(ToolCallStream):
    """Forced function (named `tool_choice`): the whole output is the call's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._held = ""  # trailing whitespace, sent only if more arguments follow
        self._begun = False

    def feed(self, text: str) -> list[Delta]:
        out = self._header()
        text = self._held + text
        if not self._begun:
            text = text.lstrip()
        body = text.rstrip()
        self._held = text[len(body) :]
        if body:
            self._begun = True
            self._arguments(out, 0, body)
        return out

    def finish(self) -> list[Delta]:
        self._held = ""
        return self._header()

    def _header(self) -> list[Delta]:
        out: list[Delta] = []
        if not self.tool_calls:
            self._begin_call(out, self._name)
        return out


class RequiredStream(ToolCallStream):
    """`tool_choice: "required"`: a JSON array of `{"name": ..., "parameters": {...}}`, read
    by a small scanner (strings, escapes, depth). An element becomes a call as soon as its
    name is whole and its parameters object has begun (header first, as vLLM streams it);
    the parameters' text then follows as arguments while it is generated. An element that
    closes without having become one is checked whole (parameters before the name, or
    none). Text that became no call by the end of an output cut short (the array still
    open) is the message's `content`."""

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0  # 1: in the array; 2: in an element; more: in a value inside it
        self._in_string = self._escaped = self._done = False
        self._pending: list[str] = []  # text since the last call that belongs to no call
        self._new_element("")

    def _new_element(self, first: str) -> None:
        self._element = [first] if first else []
        self._want_key = True  # the element's next string is a key
        self._key: Any = None  # the element's last key
        self._string_at = 0  # where the element-level string being read starts
        self._is_key = False
        self._name: Any = None
        self._args: list[int] = []  # [start] or [start, end] of the parameters' text
        self._call: int | None = None
        self._args_sent = 0

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        for ch in text:
            if self._done:
                break
            if self._depth == 0:
                self._pending.append(ch)
                self._depth = 1 if ch == "[" else 0
                self._done = not ch.isspace() and ch != "["
                continue
            if self._call is None:
                self._pending.append(ch)
            if self._depth >= 2:
                self._element.append(ch)
            self._scan(ch, out)
            if self._call is None and self._name is not None and self._args:
                self._pending = []
                self._call = self._begin_call(out, self._name)
        self._send_arguments(out)
        return out

    def _scan(self, ch: str, out: list[Delta]) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 2:
                    self._string_read()
        elif ch == '"':
            self._in_string = True
            if self._depth == 2:
                self._string_at, self._is_key = len(self._element) - 1, self._want_key
                self._want_key = False
        elif ch in "{[":
            self._depth += 1
            if self._depth == 2:
                self._new_element(ch)
            elif self._depth == 3 and self._key == "parameters" and ch == "{" and not self._args:
                self._args = [len(self._element) - 1]
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 2 and self._key == "parameters" and len(self._args) == 1:
                self._args.append(len(self._element))
            elif self._depth == 1:
                self._end_element(out)
            elif self._depth == 0:
                self._done = True
        elif self._depth == 2 and ch == ",":
            self._want_key = True

    def _string_read(self) -> None:
        value = loads_or_none("".join(self._element[self._string_at :]))
        if self._is_key:
            self._key = value
        elif self._key == "name" and isinstance(value, str):
            self._name = value

    def _send_arguments(self, out: list[Delta]) -> None:
        if self._call is not None and self._args:
            end = self._args[1] if len(self._args) == 2 else len(self._element)
            self._arguments(
                out, self._call, "".join(self._element[self._args[0] + self._args_sent : end])
            )
            self._args_sent = end - self._args[0]

    def _end_element(self, out: list[Delta]) -> None:
        if self._call is None:
            value = loads_or_none("".join(self._element))
            parameters = value.get("parameters", {}) if isinstance(value, dict) else None
            if isinstance(parameters, dict) and isinstance(self._name, str):
                arguments = (
                    "".join(self._element[self._args[0] : self._args[1]])
                    if len(self._args) == 2
                    else _dumps(parameters)
                )
                if arguments is not None:
                    self._arguments(out, self._begin_call(out, self._name), arguments)
        else:
            self._send_arguments(out)
        self._pending = []
        self._new_element("")

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        left = "".join(self._pending).strip().lstrip(",").strip()
        if not self._done and left:
            out.append({"content": left})
        self._pending, self._done = [], True
        return out


TOOL_PARSERS: dict[str, Callable[[], ToolCallStream]] = {"hermes": HermesStream}
"""Output formats for `tool_choice: "auto"`, by `--tool-call-parser` name."""


def get_tool_parser(name: str) -> Callable[[], ToolCallStream]:
    """The parser named by `--tool-call-parser`; ValueError listing the names if unknown."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of: {', '.join(sorted(TOOL_PARSERS))}"
        ) from None
