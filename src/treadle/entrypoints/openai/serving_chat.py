"""`POST /v1/chat/completions`: messages in (through the chat template, with the tools the
plan lets reach it), a `chat.completion` body or its stream out; with --reasoning-parser, each
choice's thinking is split off first (`reasoning.py`); with tools, the rest of its text goes
through the plan's parser and becomes `content` and `tool_calls`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from treadle.entrypoints.openai.logprobs import LogprobWriter, prompt_logprobs_json
from treadle.entrypoints.openai.protocol import ChatCompletionRequest, now, random_id
from treadle.entrypoints.openai.reasoning import (
    Mode,
    ReasoningSplit,
    first_mode,
    reasoning_fields,
    split_reasoning,
)
from treadle.entrypoints.openai.serving_base import (
    ChoiceProgress,
    Outputs,
    ServingBase,
    StreamUsage,
    logprob_work,
    usage,
)
from treadle.entrypoints.openai.tool_calls import (
    Delta,
    ToolCallStream,
    ToolPlan,
    finish_reason,
    plan_tools,
)
from treadle.outputs import CompletionOutput, RequestOutput
from treadle.validation import InvalidRequest


class ChatServing:
    def __init__(self, base: ServingBase):
        self.base = base

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        base = self.base
        lora = base.check_model(req.model)
        rank = base.dp_rank(raw)
        truncate = base.check_without_prompt(req)
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("top_logprobs", "needs `logprobs: true`")
        front = base.engine.config.frontend
        plan = plan_tools(
            req.tools,
            req.tool_choice,
            auto_parser=front.tool_call_parser,
            exclude_tools_when_none=front.exclude_tools_when_tool_choice_none,
            parallel_tool_calls=req.parallel_tool_calls is not False,
        )
        names = {"logprobs": "top_logprobs", "prompt": "messages"}  # the errors' fields as sent
        try:
            text, ids, images = await base.inputs.chat_prompt(req, truncate, plan.template_tools)
        except InvalidRequest as e:
            raise e.renamed(names) from None
        top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:
            max_tokens, names["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
        rid = random_id("chatcmpl")
        try:
            requests = await base.prepare(
                req,
                rid,
                max_tokens,
                [(text, ids)],
                top,
                req.prompt_logprobs,
                truncate,
                plan.structured_outputs,
                images=[images],
                lora=lora,
            )
        except InvalidRequest as e:
            raise e.renamed(names) from None
        mode = None
        if front.reasoning_parser is not None:
            shown = base.tokenizer.decode(ids) if text is None else text  # (cut: text None)
            mode = first_mode(front.reasoning_parser, shown, req.chat_template_kwargs)
            _check_constraint(mode, requests[0].params.structured_outputs is not None, plan)
        writer = LogprobWriter(base.token_text, req.return_tokens_as_token_ids)
        job = _Chat(req, plan, ids, rid, base.shown_model(lora), writer, mode)
        outputs = base.run(requests, rank)
        if req.stream:
            return base.stream(job.events(outputs), outputs, rid)
        return await base.until_done(raw, self._body(job, outputs))

    async def _body(self, job: _Chat, outputs: Outputs) -> dict[str, Any]:
        final: RequestOutput | None = None
        async for _, out in outputs:
            final = out
        assert final is not None
        return await self.base.inputs.run(logprob_work([final]), job.body, final)


def _check_constraint(mode: Mode, constrained: bool, plan: ToolPlan) -> None:
    """vLLM applies a request's structured output after the thinking; treadle's would
    constrain the thinking too, so a constrained request must come with thinking closed."""
    if constrained and mode != "content":
        raise InvalidRequest(
            "tool_choice" if plan.structured_outputs is not None else "response_format",
            "structured outputs (a JSON schema, grammar, or a required or named tool choice) "
            "are not supported together with --reasoning-parser while the model thinks: the "
            "constraint would apply to the thinking too; turn the thinking off (e.g. "
            '`chat_template_kwargs: {"enable_thinking": false}`) or leave the constraint out',
        )


@dataclass
class _Progress(ChoiceProgress):
    parser: ToolCallStream | None = None
    """The choice's tool call parser (None when the plan has no tools to parse)."""
    split: ReasoningSplit | None = None
    """The choice's reasoning splitter (None without --reasoning-parser)."""


@dataclass(frozen=True)
class _Chat:
    """One chat request, checked: how its outputs become a body or chunks."""

    req: ChatCompletionRequest
    plan: ToolPlan
    prompt_ids: list[int]
    rid: str
    model_name: str
    writer: LogprobWriter
    reasoning: Mode | None = None
    """Where each choice's output starts (None: no reasoning parser)."""

    def body(self, final: RequestOutput) -> dict[str, Any]:
        """The response to the final output."""
        req = self.req
        choices, completion_tokens = [], 0
        for comp in final.outputs:
            completion_tokens += len(comp.token_ids)
            message: dict[str, Any] = {"role": "assistant", "content": comp.text}
            text = comp.text
            if self.reasoning is not None:
                thought, content = split_reasoning(self.reasoning, comp.text)
                message["content"], text = content, content or ""
                message |= reasoning_fields(thought if req.include_reasoning else None)
            calls = 0
            if self.plan.mode != "none":
                parsed = self.plan.parse(text)
                tool_calls = (
                    parsed.tool_calls[:1] if req.parallel_tool_calls is False else parsed.tool_calls
                )
                message["content"], calls = parsed.content, len(tool_calls)
                if tool_calls:
                    message["tool_calls"] = tool_calls
            choices.append(
                {
                    "index": comp.index,
                    "message": message,
                    "logprobs": None
                    if comp.logprobs is None
                    else self.writer.chat(comp.token_ids, comp.logprobs, req.top_logprobs or 0),
                    "finish_reason": finish_reason(comp.finish_reason, calls),
                    "stop_reason": comp.stop_reason,
                    "token_ids": list(comp.token_ids) if req.return_token_ids else None,
                }
            )
        prompt_ids = self.prompt_ids
        return {
            **self._head("chat.completion"),
            "choices": choices,
            "usage": usage(len(prompt_ids), completion_tokens),
            "prompt_logprobs": None
            if req.prompt_logprobs is None
            else prompt_logprobs_json(prompt_ids, final.prompt_logprobs),
            "prompt_token_ids": prompt_ids if req.return_token_ids else None,
        }

    async def events(self, outputs: Outputs) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks: once the first output has come, a role chunk per choice (as
        vLLM's); then for each output of each choice that brings tokens or ends it, a chunk
        per delta (the last with the finish_reason); then the usage chunk if asked for."""
        head, req = self._head("chat.completion.chunk"), self.req
        stream_usage = StreamUsage.of(req.stream_options)
        prompt_tokens = len(self.prompt_ids)
        progress: dict[int, _Progress] = {}
        opening = self._opening()
        async for _, out in outputs:
            for chunk in opening:
                yield {**head, **chunk, **stream_usage.so_far(prompt_tokens, 0)}
            opening = []
            for comp in out.outputs:
                choice = progress.setdefault(comp.index, self._progress())
                if choice.finished:
                    continue
                for chunk in self._chunks(comp, choice):
                    yield {
                        **head,
                        "choices": [chunk],
                        **stream_usage.so_far(prompt_tokens, choice.tokens),
                    }
        if stream_usage.last:
            completion_tokens = sum(choice.tokens for choice in progress.values())
            yield {**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}

    def _opening(self) -> list[dict[str, Any]]:
        """vLLM's first chunks: one per choice, with the role (and the prompt's token ids)."""
        ids = {"prompt_token_ids": self.prompt_ids} if self.req.return_token_ids else {}
        role = {"role": "assistant", "content": ""}
        return [
            {"choices": [{"index": k, "delta": role, "logprobs": None, "finish_reason": None}]}
            | ids
            for k in range(self.req.n)
        ]

    def _progress(self) -> _Progress:
        return _Progress(
            parser=None if self.plan.mode == "none" else self.plan.stream(),
            split=None if self.reasoning is None else ReasoningSplit(self.reasoning),
        )

    def _chunks(self, comp: CompletionOutput, choice: _Progress) -> list[dict[str, Any]]:
        """The choice's chunks for `comp` (and `choice` moved on): each delta its own chunk,
        the last one with the logprobs and the finish_reason."""
        req = self.req
        text, ids = choice.new(comp)
        if not text and not ids and not comp.finished:
            return []  # as vLLM: a chunk per output that brings tokens, or the end
        pieces, calls = self._deltas(choice, text, comp.finished)
        logprobs = (
            None
            if comp.logprobs is None
            else self.writer.chat(ids, comp.logprobs[choice.tokens :], req.top_logprobs or 0)
        )
        if not pieces and (comp.finished or logprobs is not None or req.return_token_ids):
            pieces = [{}]  # the finish_reason, or what came with text a parser holds back
        chunks: list[dict[str, Any]] = []
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            chunk = {
                "index": comp.index,
                "delta": piece,
                "logprobs": logprobs if last else None,
                "finish_reason": finish_reason(comp.finish_reason, calls) if last else None,
                "stop_reason": comp.stop_reason if last else None,
            }
            if req.return_token_ids:
                chunk["token_ids"] = ids if last else []
            chunks.append(chunk)
        choice.sent(comp)
        return chunks

    def _deltas(self, choice: _Progress, text: str, finished: bool) -> tuple[list[Delta], int]:
        """A choice's deltas for its new text, and the tool calls it has made so far. With a
        reasoning parser, the thinking comes first and only the rest reaches the tool parser;
        thinking and plain content that arrive in one output share one delta (as vLLM's)."""
        if choice.split is None:
            return self._content_deltas(choice.parser, text, finished)
        thought, content = choice.split.feed(text) if text else ("", "")
        if finished:
            more_thought, more_content = choice.split.finish()
            thought, content = thought + more_thought, content + more_content
        out, calls = self._content_deltas(choice.parser, content, finished, quiet=True)
        if thought and self.req.include_reasoning:
            first = reasoning_fields(thought)
            if out and set(out[0]) == {"content"}:
                return [{**first, **out[0]}, *out[1:]], calls
            return [first, *out], calls
        return out, calls

    def _content_deltas(
        self, parser: ToolCallStream | None, text: str, finished: bool, quiet: bool = False
    ) -> tuple[list[Delta], int]:
        """The deltas of the answer's text (`quiet`: none for no text)."""
        if parser is None:
            return ([{"content": text}] if text or not quiet else []), 0
        out = parser.feed(text) if text else []
        if finished:
            out += parser.finish()
        if self.req.parallel_tool_calls is False:  # only the first call
            out = [d for d in out if all(c["index"] == 0 for c in d.get("tool_calls", ()))]
            return out, min(parser.tool_calls, 1)
        return out, parser.tool_calls

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.rid, "object": kind, "created": now(), "model": self.model_name}
