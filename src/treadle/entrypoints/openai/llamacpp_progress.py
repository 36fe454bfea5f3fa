"""One llama.cpp-style completion's progress (`/completion`, `/infill`): the text so far,
llama.cpp's early stops (`n_indent`, `t_max_predict_ms`), what a stream may send, and the
final body in llama.cpp's shape with its timings and `response_fields`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from treadle.outputs import RequestOutput

if TYPE_CHECKING:
    from treadle.entrypoints.openai.llamacpp_completion import LlamaCompletionRequest
    from treadle.entrypoints.openai.llamacpp_slots import Slot
    from treadle.entrypoints.openai.serving_base import Outputs

SAMPLERS = ("penalties", "top_k", "top_p", "min_p", "temperature", "infill")
"""The samplers a request may name, in the order they run."""


@dataclass
class CompletionJob:
    """One request's progress: the text so far, llama.cpp's early stops, and its timings."""

    req: LlamaCompletionRequest
    prompt_ids: list[int]
    prompt_only: bool
    model_name: str
    started: float
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cached: int = 0
    stop_type: str = "none"
    stopping_word: str = ""
    first_token: float | None = None
    finished: float | None = None
    has_new_line: bool = False
    last_nl: int = 0
    sent: int = 0
    slot: Slot | None = None
    """The slot it runs in (`llamacpp_slots.py`), whose progress it keeps up to date."""

    def take(self, out: RequestOutput) -> bool:
        """Take an output; True when the request is over (the engine's end or an early stop)."""
        self.cached = out.num_cached_tokens
        comp = out.outputs[0]
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        if self.prompt_only:
            if out.finished:
                self.stop_type, self.finished = "limit", now
            return out.finished
        # llama.cpp's time limit counts once a new line has been generated before this token
        late = (
            self.req.t_max_predict_ms > 0
            and now - self.first_token > self.req.t_max_predict_ms / 1e3
        )
        timed_out = self.has_new_line and late
        self.text, self.token_ids = comp.text, list(comp.token_ids)
        self.has_new_line = self.has_new_line or "\n" in self.text
        if self.slot is not None:
            self.slot.n_decoded, self.slot.has_new_line = len(self.token_ids), self.has_new_line
        if self._short_indent() or (timed_out and not comp.finished):
            self.stop_type, self.finished = "limit", now
            return True
        if comp.finished:
            self.finished = now
            if comp.finish_reason == "length":
                self.stop_type = "limit"
            elif isinstance(comp.stop_reason, str):
                self.stop_type, self.stopping_word = "word", comp.stop_reason
            else:
                self.stop_type = "eos"
        return comp.finished

    def _short_indent(self) -> bool:
        """llama.cpp's `n_indent`, once per token as there: the line after the last new line
        seen is indented less than asked: cut it (its indentation stays) and stop; then the
        next new line is looked for."""
        if self.req.n_indent <= 0:
            return False
        if self.last_nl > 0:
            pos = self.last_nl
            while pos < len(self.text) and self.text[pos] in " \t":
                pos += 1
            if pos < len(self.text) and pos - self.last_nl < self.req.n_indent:
                self.text = self.text[:pos]
                return True
        nl = self.text.find("\n", self.last_nl)
        if nl != -1:
            self.last_nl = nl + 1
        return False

    def safe_text(self) -> str:
        """The text a stream may send now: with `n_indent`, not a line's indentation before
        the line shows whether it is kept."""
        if self.req.n_indent <= 0 or self.finished is not None:
            return self.text
        nl = self.text.rfind("\n")
        if nl != -1 and not self.text[nl + 1 :].strip(" \t"):
            return self.text[: nl + 1]
        return self.text

    def partial(self) -> dict[str, Any] | None:
        text = self.safe_text()
        if len(text) <= self.sent:
            return None
        delta, self.sent = text[self.sent :], len(text)
        return {
            "index": 0,
            "content": delta,
            "tokens": [],
            "stop": False,
            "id_slot": self.id_slot,
            "tokens_predicted": len(self.token_ids),
            "tokens_evaluated": len(self.prompt_ids),
        }

    @property
    def id_slot(self) -> int:
        return self.req.id_slot if self.slot is None else self.slot.id

    def tokens(self) -> list[int]:
        """The prompt and what was generated of it (what its slot keeps)."""
        return [*self.prompt_ids, *([] if self.prompt_only else self.token_ids)]

    def final(self, streamed: bool) -> dict[str, Any]:
        end = self.finished or time.monotonic()
        first = self.first_token or end
        predicted = 0 if self.prompt_only else len(self.token_ids)
        prompt_n = len(self.prompt_ids) - self.cached
        prompt_ms = (first - self.started) * 1e3
        predicted_ms = (end - first) * 1e3
        req = self.req
        body: dict[str, Any] = {
            "index": 0,
            "content": "" if streamed else ("" if self.prompt_only else self.text),
            "tokens": [] if streamed or self.prompt_only else self.token_ids,
            "id_slot": self.id_slot,
            "stop": True,
            "model": self.model_name,
            "tokens_predicted": predicted,
            "tokens_evaluated": len(self.prompt_ids),
            "generation_settings": {
                "n_predict": req.n_predict if req.n_predict is not None else -1,
                "temperature": req.temperature,
                "top_k": req.top_k,
                "top_p": req.top_p,
                "min_p": req.min_p,
                "seed": req.seed,
                "stop": req.stop,
                "n_indent": req.n_indent,
                "t_max_predict_ms": req.t_max_predict_ms,
                "samplers": req.samplers if req.samplers is not None else list(SAMPLERS[:-1]),
                "stream": req.stream,
            },
            "prompt": "",
            "has_new_line": self.has_new_line,
            "truncated": False,
            "stop_type": self.stop_type,
            "stopping_word": self.stopping_word,
            "tokens_cached": len(self.prompt_ids) + predicted,
            "timings": {
                "cache_n": self.cached,
                "prompt_n": prompt_n,
                "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": prompt_n / prompt_ms * 1e3 if prompt_ms else 0.0,
                "predicted_n": predicted,
                "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
                "predicted_per_second": predicted / predicted_ms * 1e3 if predicted_ms else 0.0,
            },
        }
        return _only(body, req.response_fields)

    async def body(self, outputs: Outputs) -> dict[str, Any]:
        try:
            async for _, out in outputs:
                if self.take(out):
                    break
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]  # an early stop aborts
        return self.final(streamed=False)


def _only(body: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """llama.cpp's `response_fields`: only these (paths like "timings/prompt_n" as keys)."""
    if not fields:
        return body
    picked: dict[str, Any] = {}
    for path in fields:
        value: Any = body
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            picked[path] = value
    return picked
