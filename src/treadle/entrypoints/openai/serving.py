"""Completions and chat completions: prompts in, OpenAI-shaped responses or SSE streams out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from treadle.entrypoints.openai.inputs import INLINE_CHARS, Prompt, PromptInputs, Truncation
from treadle.entrypoints.openai.logprobs import LogprobWriter, padded, prompt_logprobs_json
from treadle.entrypoints.openai.params import AnyRequest, check_fields, sampling_params
from treadle.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    UsageInfo,
    now,
    random_id,
)
from treadle.entrypoints.openai.tool_calls import (
    Delta,
    ToolCallStream,
    ToolPlan,
    finish_reason,
    plan_tools,
)
from treadle.frontend.async_llm import AsyncLLM
from treadle.frontend.core_client import EngineDeadError, RequestKilledEngineError
from treadle.logger import init_logger
from treadle.outputs import CompletionOutput, RequestOutput
from treadle.sampling_params import (
    SamplingParams,
    StructuredOutputsParams,
    generation_defaults,
)
from treadle.validation import (
    InvalidRequest,
    check_batch,
    check_max_tokens,
    is_int64,
    parse_int,
)

logger = init_logger(__name__)


class APIError(Exception):
    """An error with an HTTP status, rendered in OpenAI's JSON error shape."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        kind: str = "BadRequestError",
        param: str | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# (prompt, choice index, request output, choice output, (characters, tokens) of it already
# sent, first time) -> (choice chunks to send, whether they carry the output so far): see
# `_sse_stream`.
ChoiceChunks = Callable[
    [int, int, RequestOutput, CompletionOutput, tuple[int, int], bool],
    tuple[list[dict[str, Any]], bool],
]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    ).model_dump()


def _logprob_work(outputs: Any) -> int:
    """How many tokens a response must write logprobs for (to decide on the thread pool)."""
    return sum(
        len(out.prompt_logprobs or ())
        + sum(sum(len(entry) for entry in comp.logprobs or ()) for comp in out.outputs)
        for out in outputs
    )


def _token_ids(req: AnyRequest, prompt_ids: list[int], ids: list[int]) -> dict[str, Any]:
    """A completion choice's `prompt_token_ids` and `token_ids` (vLLM's `return_token_ids`;
    null when not asked for, as vLLM's)."""
    if not req.return_token_ids:
        return {"prompt_token_ids": None, "token_ids": None}
    return {"prompt_token_ids": list(prompt_ids), "token_ids": list(ids)}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str):
        """`model_name`: the name responses report (the first served name); the API also
        answers to the model config's other names (`treadle.config.served_names`)."""
        self.engine = engine
        self.model_name = model_name
        model = engine.config.model
        self.listed_names = tuple(dict.fromkeys((model_name, *model.served_model_name)))
        """The names /v1/models lists, as vLLM's (every served name)."""
        self.model_names = (*self.listed_names, *model.also_served_as)
        """Every name a request's `model` may be."""
        self.tokenizer = engine.tokenizer
        self.token_text = engine.output_processor.token_texts
        self.inputs = PromptInputs(engine.input_processor, engine.config.frontend)
        self.sampling_defaults = generation_defaults(engine.config.model)
        if self.sampling_defaults:
            logger.info(
                "Default sampling parameters from generation_config.json (requests that set "
                "them override them; --generation-config vllm ignores the file): %s",
                self.sampling_defaults,
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")

    def model_cards(self) -> list[ModelCard]:
        """/v1/models: a card per served name, as vLLM's; `root` is the first served name (the
        path as given unless --served-model-name says otherwise: never a resolved path)."""
        return [self._card(name) for name in self.listed_names]

    def model_card(self, model: str) -> ModelCard:
        """/v1/models/{model}: its card, for any name the model answers to; 404 otherwise."""
        self.check_model(model)
        return self._card(model)

    def _card(self, name: str) -> ModelCard:
        return ModelCard(id=name, root=self.model_name, max_model_len=self.engine.max_model_len)

    def _check_request(self, req: AnyRequest) -> Truncation | None:
        """Checks that need no prompt; returns the truncation asked for."""
        check_fields(req)
        if req.stream_options is not None and not req.stream:
            raise InvalidRequest("stream_options", "may only be given with `stream: true`")
        if req.prompt_logprobs and req.stream:
            raise InvalidRequest("prompt_logprobs", "are not available when streaming")
        k = req.truncate_prompt_tokens
        if k is None:
            return None
        most = self.engine.input_processor.limits.max_model_len - 1
        if k == -1:
            k = most  # vLLM's "as many as the model takes"
        if not 1 <= k <= most:
            raise InvalidRequest(
                "truncate_prompt_tokens",
                f"must be -1 or in [1, {most}] (this model's maximum context length is "
                f"{most + 1} tokens, with room for one output token), got {k}",
            )
        return k, req.truncation_side or "left"

    async def _params(
        self,
        req: AnyRequest,
        max_tokens: int | None,
        prompts: list[Prompt],
        logprobs: int | None,
        prompt_logprobs: int | None,
        truncate: Truncation | None,
        tool_constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's `SamplingParams`, checked with every prompt against the model (the
        same `validation` rules the engine core runs again); `tool_constraint` is the output
        a `tool_choice` forces. Raises `InvalidRequest`."""
        limits = self.engine.input_processor.limits
        longest = max(len(ids) for _, ids in prompts)
        if max_tokens is None:
            max_tokens = max(limits.max_model_len - longest, 1)
        elif is_int64(max_tokens) and max_tokens >= 1:
            check_max_tokens(max_tokens, longest, limits)
        # The prompts are already cut; "right" cuts are no rule the engine knows.
        keep_last = truncate[0] if truncate is not None and truncate[1] == "left" else None
        params = sampling_params(
            req, max_tokens, logprobs, prompt_logprobs, keep_last, self.sampling_defaults
        )
        if tool_constraint is not None:
            if params.structured_outputs is not None:  # vLLM: one or the other
                raise InvalidRequest(
                    "tool_choice",
                    "a required or named tool choice cannot be combined with structured_outputs "
                    "or response_format: ask for one of them",
                )
            params = params.clone(structured_outputs=tool_constraint)
        check_batch(len(prompts), params.n)
        # A grammar compiles on its first use: off the event loop.
        size = INLINE_CHARS if params.structured_outputs is not None else 0
        await self.inputs.run(size, self._check_prompts, prompts, params, req.priority)
        return params

    def _check_prompts(self, prompts: list[Prompt], params: SamplingParams, priority: int) -> None:
        for _, ids in prompts:
            self.engine.input_processor.check(ids, params, priority)

    def _dp_rank(self, raw: Request) -> int | None:
        """The engine a client asks for with the `X-data-parallel-rank` header (as vLLM)."""
        value = raw.headers.get("X-data-parallel-rank")
        if value is None:
            return None
        return parse_int(value, "X-data-parallel-rank", 0, self.engine.client.num_engines - 1)

    async def _run(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        rid: str,
        priority: int,
        rank: int | None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merge the output streams of several prompts: yields (prompt index, output)."""
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(i: int, text: str | None, ids: list[int]) -> None:
            try:
                async for out in self.engine.generate(
                    ids, params, f"{rid}-{i}", text, priority, rank
                ):
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put(e)
                return
            await queue.put(None)

        tasks = [asyncio.create_task(pump(i, t, ids)) for i, (t, ids) in enumerate(prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    # -- completions ---------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        rank = self._dp_rank(raw)
        truncate = self._check_request(req)
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequest(
                "max_tokens", "must be at least 1 (0 only with echo, to score the prompt alone)"
            )
        prompts = await self.inputs.completion_prompts(
            req.prompt, req.echo, truncate, req.add_special_tokens
        )
        # With echo, the prompt's logprobs come first (vLLM's rule).
        prompt_lps = req.prompt_logprobs
        if prompt_lps is None and req.echo:
            prompt_lps = req.logprobs
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens  # 0: the prompt alone
        params = await self._params(req, max_tokens, prompts, req.logprobs, prompt_lps, truncate)
        rid = random_id("cmpl")
        stream = self._run(prompts, params, rid, req.priority, rank)
        if req.stream:
            return StreamingResponse(
                self._stream_completion(req, prompts, stream, rid), media_type="text/event-stream"
            )
        return await self._until_done(raw, self._full_completion(req, prompts, stream, rid))

    def _echoed(
        self, req: CompletionRequest, prompt: Prompt, out: RequestOutput, comp: CompletionOutput
    ) -> tuple[str, list[int], list[Any]]:
        """(text, token ids, logprob entries) of a choice: with echo, the prompt's first."""
        entries: list[Any] = list(comp.logprobs or ())
        if not req.echo:
            return comp.text, comp.token_ids, entries
        text, ids = prompt[0] or "", prompt[1]
        prompt_entries = padded(ids, out.prompt_logprobs)
        if req.max_tokens == 0:
            return text, ids, prompt_entries
        return text + comp.text, [*ids, *comp.token_ids], [*prompt_entries, *entries]

    async def _full_completion(
        self,
        req: CompletionRequest,
        prompts: list[Prompt],
        stream: AsyncIterator[tuple[int, RequestOutput]],
        rid: str,
    ) -> dict[str, Any]:
        final: dict[int, RequestOutput] = {}
        async for i, out in stream:
            final[i] = out
        return await self.inputs.run(
            _logprob_work(final.values()), self._completion_body, req, prompts, final, rid
        )

    def _completion_body(
        self,
        req: CompletionRequest,
        prompts: list[Prompt],
        final: dict[int, RequestOutput],
        rid: str,
    ) -> dict[str, Any]:
        writer = LogprobWriter(self.token_text, req.return_tokens_as_token_ids)
        choices = []
        completion_tokens = 0
        for i in sorted(final):
            out = final[i]
            for comp in out.outputs:
                text, ids, entries = self._echoed(req, prompts[i], out, comp)
                completion_tokens += len(comp.token_ids)
                choices.append(
                    {
                        "index": i * req.n + comp.index,
                        "text": text,
                        "logprobs": None
                        if req.logprobs is None
                        else writer.completion(ids, entries, req.logprobs, 0),
                        "finish_reason": comp.finish_reason,
                        "stop_reason": comp.stop_reason,
                        "prompt_logprobs": None
                        if req.prompt_logprobs is None
                        else prompt_logprobs_json(prompts[i][1], out.prompt_logprobs),
                        **_token_ids(req, prompts[i][1], comp.token_ids),
                    }
                )
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {
            "id": rid,
            "object": "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
        }

    def _stream_completion(
        self,
        req: CompletionRequest,
        prompts: list[Prompt],
        stream: AsyncIterator[tuple[int, RequestOutput]],
        rid: str,
    ) -> AsyncIterator[str]:
        writer = LogprobWriter(self.token_text, req.return_tokens_as_token_ids)
        written: dict[int, int] = {}  # choice index -> characters sent (for text_offset)

        def choices(
            i: int,
            index: int,
            out: RequestOutput,
            comp: CompletionOutput,
            start: tuple[int, int],
            first: bool,
        ) -> tuple[list[dict[str, Any]], bool]:
            if first and req.echo:
                if not comp.token_ids and not comp.finished:
                    return [], False  # the prompt's logprobs may not all be in yet
                text, ids, entries = self._echoed(req, prompts[i], out, comp)
            elif req.max_tokens == 0:  # the prompt alone: no new tokens shown
                text, ids, entries = "", [], []
            else:
                text = comp.text[start[0] :]
                ids = comp.token_ids[start[1] :]
                entries = list(comp.logprobs or ())[start[1] :]
            if not text and not ids and not comp.finished:
                return [], False  # as vLLM: a chunk per output that brings tokens, or the end
            offset = written.get(index, 0)
            written[index] = offset + len(text)
            choice = {
                "index": index,
                "text": text,
                "logprobs": None
                if req.logprobs is None
                else writer.completion(ids, entries, req.logprobs, offset),
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
            }
            if req.return_token_ids:  # vLLM's: the prompt's ids in each choice's first chunk
                choice["prompt_token_ids"] = prompts[i][1] if first else None
                choice["token_ids"] = comp.token_ids[start[1] :]
            return [choice], True

        head = {"id": rid, "object": "text_completion", "created": now(), "model": self.model_name}
        prompt_lens = [len(ids) for _, ids in prompts]
        return self._sse_stream(req, head, prompt_lens, stream, choices)

    # -- chat ----------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        rank = self._dp_rank(raw)
        truncate = self._check_request(req)
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("top_logprobs", "needs `logprobs: true`")
        front = self.engine.config.frontend
        plan = plan_tools(
            req.tools,
            req.tool_choice,
            auto_parser=front.tool_call_parser,
            exclude_tools_when_none=front.exclude_tools_when_tool_choice_none,
            parallel_tool_calls=req.parallel_tool_calls is not False,
        )
        names = {"logprobs": "top_logprobs", "prompt": "messages"}
        try:
            text, ids = await self.inputs.chat_prompt(req, truncate, plan.template_tools)
        except InvalidRequest as e:
            raise e.renamed(names) from None
        top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:
            max_tokens, names["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
        try:
            params = await self._params(
                req,
                max_tokens,
                [(text, ids)],
                top,
                req.prompt_logprobs,
                truncate,
                plan.structured_outputs,
            )
        except InvalidRequest as e:
            raise e.renamed(names) from None
        rid = random_id("chatcmpl")
        stream = self._run([(text, ids)], params, rid, req.priority, rank)
        if req.stream:
            return StreamingResponse(
                self._stream_chat(req, plan, ids, stream, rid),
                media_type="text/event-stream",
            )
        return await self._until_done(raw, self._full_chat(req, plan, ids, stream, rid))

    async def _full_chat(
        self,
        req: ChatCompletionRequest,
        plan: ToolPlan,
        prompt_ids: list[int],
        stream: AsyncIterator[tuple[int, RequestOutput]],
        rid: str,
    ) -> dict[str, Any]:
        final: RequestOutput | None = None
        async for _, out in stream:
            final = out
        assert final is not None
        return await self.inputs.run(
            _logprob_work([final]), self._chat_body, req, plan, prompt_ids, final, rid
        )

    def _chat_body(
        self,
        req: ChatCompletionRequest,
        plan: ToolPlan,
        prompt_ids: list[int],
        final: RequestOutput,
        rid: str,
    ) -> dict[str, Any]:
        writer = LogprobWriter(self.token_text, req.return_tokens_as_token_ids)
        choices, completion_tokens = [], 0
        for comp in final.outputs:
            completion_tokens += len(comp.token_ids)
            message: dict[str, Any] = {"role": "assistant", "content": comp.text}
            calls = 0
            if plan.mode != "none":
                parsed = plan.parse(comp.text)
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
                    else writer.chat(comp.token_ids, comp.logprobs, req.top_logprobs or 0),
                    "finish_reason": finish_reason(comp.finish_reason, calls),
                    "stop_reason": comp.stop_reason,
                    "token_ids": list(comp.token_ids) if req.return_token_ids else None,
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(len(prompt_ids), completion_tokens),
            "prompt_logprobs": None
            if req.prompt_logprobs is None
            else prompt_logprobs_json(prompt_ids, final.prompt_logprobs),
            "prompt_token_ids": prompt_ids if req.return_token_ids else None,
        }

    def _stream_chat(
        self,
        req: ChatCompletionRequest,
        plan: ToolPlan,
        prompt_ids: list[int],
        stream: AsyncIterator[tuple[int, RequestOutput]],
        rid: str,
    ) -> AsyncIterator[str]:
        writer = LogprobWriter(self.token_text, req.return_tokens_as_token_ids)
        parsers: dict[int, ToolCallStream] = {}  # per choice, when tools are planned

        def deltas(index: int, text: str, finished: bool) -> tuple[list[Delta], int]:
            """The choice's deltas for its new text, and the tool calls it has made so far."""
            if plan.mode == "none":
                return [{"content": text}], 0
            parser = parsers.setdefault(index, plan.stream())
            out = parser.feed(text) if text else []
            if finished:
                out += parser.finish()
            if req.parallel_tool_calls is False:  # only the first call
                out = [d for d in out if all(c["index"] == 0 for c in d.get("tool_calls", ()))]
                return out, min(parser.tool_calls, 1)
            return out, parser.tool_calls

        def choices(
            i: int,
            index: int,
            _: RequestOutput,
            comp: CompletionOutput,
            start: tuple[int, int],
            first: bool,
        ) -> tuple[list[dict[str, Any]], bool]:
            text, ids = comp.text[start[0] :], comp.token_ids[start[1] :]
            if not text and not ids and not comp.finished:
                return [], False  # as vLLM: a chunk per output that brings tokens, or the end
            pieces, calls = deltas(index, text, comp.finished)
            logprobs = (
                None
                if comp.logprobs is None
                else writer.chat(ids, comp.logprobs[start[1] :], req.top_logprobs or 0)
            )
            if not pieces and (comp.finished or logprobs is not None or req.return_token_ids):
                pieces = [{}]  # the finish_reason, or what came with text a parser holds back
            out: list[dict[str, Any]] = []
            for n, piece in enumerate(pieces):  # each delta its own chunk; the last ends it
                last = n == len(pieces) - 1
                choice = {
                    "index": index,
                    "delta": piece,
                    "logprobs": logprobs if last else None,
                    "finish_reason": finish_reason(comp.finish_reason, calls) if last else None,
                    "stop_reason": comp.stop_reason if last else None,
                }
                if req.return_token_ids:
                    choice["token_ids"] = ids if last else []
                out.append(choice)
            return out, True

        # vLLM's first chunks: one per choice, with the role (and the prompt's token ids).
        ids_field = {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}
        role = {"role": "assistant", "content": ""}
        opening = [
            {"choices": [{"index": k, "delta": role, "logprobs": None, "finish_reason": None}]}
            | ids_field
            for k in range(req.n)
        ]
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": now(),
            "model": self.model_name,
        }
        return self._sse_stream(req, head, [len(prompt_ids)], stream, choices, opening)

    async def _sse_stream(
        self,
        req: AnyRequest,
        head: dict[str, Any],
        prompt_lens: list[int],
        stream: AsyncIterator[tuple[int, RequestOutput]],
        choices: ChoiceChunks,
        opening: Sequence[dict[str, Any]] = (),
    ) -> AsyncIterator[str]:
        """Server-sent events for both streaming endpoints. `opening`: events (without the
        head) sent once the first output has come, before it (chat's role chunks; no tokens
        yet in their usage). For each output of each choice (index = prompt * n + sample)
        until that choice has finished, `choices(prompt, index, request output, choice output,
        (text, tokens) already sent, first)` gives the choice chunks to send and whether they
        carry the output so far; a choice's last chunk (with its finish_reason) is sent once.
        Then the usage chunk if asked for (and usage so far in every chunk with
        `continuous_usage_stats`); an error as an error event; always `[DONE]` last."""
        sent: dict[int, tuple[int, int]] = {}  # index -> (characters, tokens) sent
        seen: set[int] = set()
        done: set[int] = set()
        options = req.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options is not None and options.continuous_usage_stats
        try:
            async for i, out in stream:
                for event in opening:
                    usage = {"usage": _usage(prompt_lens[0], 0)} if continuous else {}
                    yield _sse({**head, **event, **usage})
                opening = ()
                for comp in out.outputs:
                    index = i * req.n + comp.index
                    if index in done:
                        continue
                    first = index not in seen
                    chunks, carried = choices(i, index, out, comp, sent.get(index, (0, 0)), first)
                    if chunks:
                        seen.add(index)
                    if carried:
                        sent[index] = (len(comp.text), len(comp.token_ids))
                        if comp.finished:
                            done.add(index)
                    for chunk in chunks:
                        event = {**head, "choices": [chunk]}
                        if continuous:
                            used = sent.get(index, (0, 0))[1]
                            event["usage"] = _usage(prompt_lens[i], used)
                        yield _sse(event)
            if include_usage:
                completion_tokens = sum(tokens for _, tokens in sent.values())
                prompt_tokens = sum(prompt_lens)
                yield _sse(
                    {**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}
                )
        except EngineDeadError as e:
            yield _sse(error_body(str(e), 503, "EngineDeadError"))
        except RequestKilledEngineError as e:
            yield _sse(error_body(str(e), 500, "InternalServerError"))
        except InvalidRequest as e:
            yield _sse(error_body(e.message, 400, "BadRequestError", e.param))
        except APIError as e:
            yield _sse(error_body(e.message, e.status, e.kind, e.param))
        except ValueError as e:
            yield _sse(error_body(str(e), 400, "BadRequestError"))
        except Exception as e:  # a bug: the client still gets an error event and [DONE]
            logger.exception("Streaming request %s failed", head.get("id"))
            yield _sse(
                error_body(f"internal error: {type(e).__name__}", 500, "InternalServerError")
            )
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    # -- helpers -------------------------------------------------------------------------------

    async def _until_done(self, raw: Request, work: Any) -> Any:
        """Await a non-streaming response, abandoning (and so aborting) it if the client leaves."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return JSONResponse(task.result())
            if await raw.is_disconnected():
                task.cancel()
                return JSONResponse(
                    error_body("client disconnected", 499, "ClientDisconnected"), status_code=499
                )
