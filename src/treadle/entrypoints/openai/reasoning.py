"""`--reasoning-parser`: a chat answer's thinking, `<think>...</think>`, split from its answer,
as vLLM's reasoning parsers split it, into `reasoning_content` (DeepSeek's name, which vLLM
returned first) and `reasoning` (vLLM's newer name for the same text) beside `content`.

The split works on text, so the tags may be special tokens or plain text that takes several
tokens (a tag split across stream deltas is held back until it is whole).

- `deepseek_r1`: everything before the first `</think>` is reasoning, whether the output
  opens with `<think>` or not (DeepSeek-R1 leaves it out; its template puts it in the prompt).
- `qwen3`: reasoning only when the output opens with `<think>` (after white space) or the
  prompt left a `<think>` open (Qwen3's thinking templates do); otherwise it is all content.
- Both: a leading `<think>` is dropped; text after `</think>` is content, as it came (its
  leading new lines too); an output that ends before `</think>` is all reasoning (vLLM's
  newer parsers: the thinking was cut). When the prompt already closed the thinking (its last
  tag is `</think>`, as Qwen3's template writes it for `enable_thinking: false`), or a qwen3
  request sets `chat_template_kwargs.enable_thinking: false`, the whole output is content.
  vLLM decides that case so when it streams; here both forms do, so they always agree.
- Tool calls (`tools` with `tool_choice: "auto"`): only the content is read for them.
- `include_reasoning: false` (vLLM's request field): the reasoning is dropped from the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def check_reasoning_parser(name: str | None) -> None:
    """Raises ValueError for a name treadle has no parser for."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser {name!r} is not available; treadle has "
            f"{' and '.join(REASONING_PARSERS)}"
        )


Mode = Literal["open", "reasoning", "content"]


def first_mode(parser: str, prompt: str, chat_template_kwargs: dict[str, Any] | None) -> Mode:
    """Where a choice's output starts: in the reasoning, in the content, or "open" (qwen3: it
    depends on whether the output opens with `<think>`)."""
    if parser == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking") is False:
        return "content"
    end, start = prompt.rfind(END), prompt.rfind(START)
    if end > start:
        return "content"
    if start > end:
        return "reasoning"
    return "reasoning" if parser == "deepseek_r1" else "open"


@dataclass
class ReasoningSplit:
    """One choice's output read as it streams: `feed(delta)` and, once, `finish()` return
    `(reasoning, content)` texts for what may be sent now; text that could still be the
    start of a tag is held back until the next delta or `finish()`."""

    mode: Mode
    held: str = ""
    stripped: bool = False
    """Whether the leading `<think>` has been looked for (and dropped) yet."""

    def feed(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        if self.mode == "content":
            return "", text
        if not self.stripped:
            head = text.lstrip()
            if START.startswith(head) and head != START:
                self.held = text  # still maybe "<think>"
                return "", ""
            self.stripped = True
            if head.startswith(START):
                text = head[len(START) :]
                self.mode = "reasoning"
            elif self.mode == "open":
                self.mode = "content"
                return "", text
        cut = text.find(END)
        if cut >= 0:
            self.mode = "content"
            return text[:cut], text[cut + len(END) :]
        keep = _partial_tail(text, END)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What is still held: the output ended there."""
        text, self.held = self.held, ""
        return (text, "") if self.mode == "reasoning" else ("", text)


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(mode: Mode, text: str) -> tuple[str | None, str | None]:
    """A whole output's `(reasoning, content)` as vLLM's non-streamed answer has them: None for
    an empty part once there was reasoning; the whole text as content when there was none."""
    if mode == "content" or (mode == "open" and not text.lstrip().startswith(START)):
        return None, text
    split = ReasoningSplit(mode)
    reasoning, content = split.feed(text)
    more_reasoning, more_content = split.finish()
    return (reasoning + more_reasoning) or None, (content + more_content) or None


def reasoning_fields(text: str | None) -> dict[str, str | None]:
    """The reasoning under both of vLLM's names."""
    return {"reasoning_content": text, "reasoning": text}
