"""Incremental, UTF-8-safe detokenization with stop strings.

Each step decodes only a short window of tokens: `prefix` (already emitted, kept for context
such as a leading space) and the new ones. Text is emitted only when it does not end in a
replacement character, so half of a multi-byte character is never shown. While streaming,
the last `len(longest stop string) - 1` characters are held back, since they may be the
start of a stop string.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self.tokens = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string if one now appears (the text is cut there)."""
        start = max(0, len(self.output_text) - max(self.hold_back, 0))
        for token in new_token_ids:
            self.tokens.append(token)
            prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            text = self._decode(self.tokens[self.prefix_offset :])
            if len(text) > len(prefix) and not text.endswith("\ufffd"):
                self.output_text += text[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return self._check_stop(start)

    def _check_stop(self, start: int) -> str | None:
        """The stop string that occurs first in the new text (the earlier-listed one on a tie)."""
        found = [(self.output_text.find(stop, start), stop) for stop in self.stop]
        found = [(at, stop) for at, stop in found if at >= 0]
        if not found:
            return None
        at, stop = min(found, key=lambda f: f[0])
        end = at + len(stop) if self.include_stop else at
        self.output_text = self.output_text[:end]
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text so far, less a possible stop-string start while unfinished."""
        if finished or self.hold_back <= 0:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self.hold_back)]

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))
