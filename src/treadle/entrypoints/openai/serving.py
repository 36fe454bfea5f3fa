"""Completions and chat completions: prompts in, OpenAI-shaped responses or SSE streams out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from treadle.entrypoints.openai.inputs import PromptInputs
from treadle.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    UsageInfo,
    now,
    random_id,
)
from treadle.frontend.async_llm import AsyncLLM
from treadle.frontend.core_client import EngineDeadError
from treadle.logger import init_logger
from treadle.outputs import CompletionOutput, RequestOutput
from treadle.sampling_params import SamplingParams
from treadle.validation import InvalidRequest, check_batch, check_max_tokens, is_int64

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


# (prompt, choice index, output, (characters, tokens) already sent, first time) ->
# (choice chunks to send, whether they carry the output so far): see `_sse_stream`.
ChoiceChunks = Callable[
    [int, int, CompletionOutput, tuple[int, int], bool], tuple[list[dict[str, Any]], bool]
]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    ).model_dump()


def _logprob_work(outputs: Any) -> int:
    """How many tokens a response must decode for its logprobs (to decide on the thread pool)."""
    return sum(
        sum(len(entry) for entry in comp.logprobs)
        for out in outputs
        for comp in out.outputs
        if comp.logprobs is not None
    )


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.inputs = PromptInputs(engine.input_processor, engine.config.frontend)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")

    def _params(
        self,
        req: Any,
        max_tokens: int | None,
        prompts: list[tuple[str | None, list[int]]],
        logprobs: int | None,
    ) -> SamplingParams:
        """The request's `SamplingParams`, checked with every prompt against the model (the
        same `validation` rules the engine core runs again). Raises `InvalidRequest`."""
        limits = self.engine.input_processor.limits
        longest = max(len(ids) for _, ids in prompts)
        if max_tokens is None:
            max_tokens = max(limits.max_model_len - longest, 1)
        elif is_int64(max_tokens) and max_tokens >= 1:
            check_max_tokens(max_tokens, longest, limits)
        params: SamplingParams = req.sampling_params(max_tokens, logprobs)
        check_batch(len(prompts), params.n)
        for _, ids in prompts:
            self.engine.input_processor.check(ids, params, req.priority)
        return params

    def _dp_rank(self, raw: Request) -> int | None:
        """The engine a client asks for with the `X-data-parallel-rank` header (as vLLM)."""
        value = raw.headers.get("X-data-parallel-rank")
        if value is None:
            return None
        engines = self.engine.client.num_engines
        if not value.strip().isdigit() or int(value) >= engines:
            raise APIError(
                f"X-data-parallel-rank must be an engine rank in [0, {engines}), not {value!r}",
                param="X-data-parallel-rank",
            )
        return int(value)

    async def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
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
        prompts = await self.inputs.completion_prompts(req.prompt, req.echo)
        params = self._params(req, req.max_tokens, prompts, req.logprobs)
        rid = random_id("cmpl")
        stream = self._run(prompts, params, rid, req.priority, rank)
        if req.stream:
            return StreamingResponse(
                self._stream_completion(req, prompts, stream, rid), media_type="text/event-stream"
            )
        return await self._until_done(raw, self._full_completion(req, prompts, stream, rid))

    def _completion_logprobs(
        self, comp: CompletionOutput, start: int, text_offset: int
    ) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        assert comp.logprobs is not None
        offset = text_offset
        for tok, entry in zip(comp.token_ids[start:], comp.logprobs[start:], strict=False):
            piece = entry[tok].decoded_token or ""
            tokens.append(piece)
            token_lps.append(entry[tok].logprob)
            # vLLM's shape: the top-k and the sampled token (k + 1 entries when it is not
            # among them)
            tops.append({lp.decoded_token: lp.logprob for lp in entry.values()})
            offsets.append(offset)
            offset += len(piece)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    async def _full_completion(
        self,
        req: CompletionRequest,
        prompts: list[tuple[str | None, list[int]]],
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
        prompts: list[tuple[str | None, list[int]]],
        final: dict[int, RequestOutput],
        rid: str,
    ) -> dict[str, Any]:
        choices = []
        completion_tokens = 0
        for i in sorted(final):
            out = final[i]
            prompt_text = prompts[i][0] or ""  # set for every prompt when echo is asked
            for comp in out.outputs:
                text = (prompt_text + comp.text) if req.echo else comp.text
                completion_tokens += len(comp.token_ids)
                choices.append(
                    {
                        "index": i * req.n + comp.index,
                        "text": text,
                        "logprobs": None
                        if comp.logprobs is None
                        else self._completion_logprobs(
                            comp, 0, len(prompt_text) if req.echo else 0
                        ),
                        "finish_reason": comp.finish_reason,
                        "stop_reason": comp.stop_reason,
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
        prompts: list[tuple[str | None, list[int]]],
        stream: AsyncIterator[tuple[int, RequestOutput]],
        rid: str,
    ) -> AsyncIterator[str]:
        def choices(
            i: int, index: int, comp: CompletionOutput, start: tuple[int, int], first: bool
        ) -> tuple[list[dict[str, Any]], bool]:
            delta = comp.text[start[0] :]
            if first and req.echo:
                delta = (prompts[i][0] or "") + delta
            if not delta and not comp.finished and not first:
                return [], False
            choice = {
                "index": index,
                "text": delta,
                "logprobs": None
                if comp.logprobs is None
                else self._completion_logprobs(comp, start[1], start[0]),
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
            }
            return [choice], True

        head = {"id": rid, "object": "text_completion", "created": now(), "model": self.model_name}
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return self._sse_stream(req, head, prompt_tokens, stream, choices)

    # -- chat ----------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        rank = self._dp_rank(raw)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("top_logprobs", "needs `logprobs: true`")
        names = {"logprobs": "top_logprobs", "prompt": "messages"}
        try:
            text, ids = await self.inputs.chat_prompt(req)
        except InvalidRequest as e:
            raise e.renamed(names) from None
        top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:
            max_tokens, names["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
        try:
            params = self._params(req, max_tokens, [(text, ids)], top)
        except InvalidRequest as e:
            raise e.renamed(names) from None
        rid = random_id("chatcmpl")
        stream = self._run([(text, ids)], params, rid, req.priority, rank)
        if req.stream:
            return StreamingResponse(
                self._stream_chat(req, len(ids), stream, rid), media_type="text/event-stream"
            )
        return await self._until_done(
            raw, self._full_chat(len(ids), stream, rid, req.top_logprobs or 0)
        )

    def _chat_logprobs(self, comp: CompletionOutput, start: int, k: int) -> dict[str, Any]:
        """OpenAI's shape: per token its logprob and exactly the `k` most likely tokens (the
        sampled one among them when its rank is at most k)."""
        content = []
        assert comp.logprobs is not None
        for tok, entry in zip(comp.token_ids[start:], comp.logprobs[start:], strict=False):
            piece = entry[tok].decoded_token or ""
            ranked = sorted(
                (lp for lp in entry.values() if lp.rank is not None and lp.rank <= k),
                key=lambda lp: lp.rank or 0,
            )
            tops = [
                {
                    "token": lp.decoded_token or "",
                    "logprob": lp.logprob,
                    "bytes": list((lp.decoded_token or "").encode()),
                }
                for lp in ranked
            ]
            content.append(
                {
                    "token": piece,
                    "logprob": entry[tok].logprob,
                    "bytes": list(piece.encode()),
                    "top_logprobs": tops,
                }
            )
        return {"content": content}

    async def _full_chat(
        self,
        prompt_len: int,
        stream: AsyncIterator[tuple[int, RequestOutput]],
        rid: str,
        top_k: int,
    ) -> dict[str, Any]:
        final: RequestOutput | None = None
        async for _, out in stream:
            final = out
        assert final is not None
        return await self.inputs.run(
            _logprob_work([final]), self._chat_body, prompt_len, final, rid, top_k
        )

    def _chat_body(
        self, prompt_len: int, final: RequestOutput, rid: str, top_k: int
    ) -> dict[str, Any]:
        choices, completion_tokens = [], 0
        for comp in final.outputs:
            completion_tokens += len(comp.token_ids)
            choices.append(
                {
                    "index": comp.index,
                    "message": {"role": "assistant", "content": comp.text},
                    "logprobs": None
                    if comp.logprobs is None
                    else self._chat_logprobs(comp, 0, top_k),
                    "finish_reason": comp.finish_reason,
                    "stop_reason": comp.stop_reason,
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(prompt_len, completion_tokens),
        }

    def _stream_chat(
        self,
        req: ChatCompletionRequest,
        prompt_len: int,
        stream: AsyncIterator[tuple[int, RequestOutput]],
        rid: str,
    ) -> AsyncIterator[str]:
        def choices(
            i: int, index: int, comp: CompletionOutput, start: tuple[int, int], first: bool
        ) -> tuple[list[dict[str, Any]], bool]:
            out: list[dict[str, Any]] = []
            if first:  # the role comes first, on its own
                role = {"role": "assistant", "content": ""}
                out.append({"index": index, "delta": role, "logprobs": None, "finish_reason": None})
            delta = comp.text[start[0] :]
            if not delta and not comp.finished:
                return out, False
            choice = {
                "index": index,
                "delta": {"content": delta} if delta else {},
                "logprobs": None
                if comp.logprobs is None
                else self._chat_logprobs(comp, start[1], req.top_logprobs or 0),
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
            }
            return [*out, choice], True

        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": now(),
            "model": self.model_name,
        }
        return self._sse_stream(req, head, prompt_len, stream, choices)

    async def _sse_stream(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        head: dict[str, Any],
        prompt_tokens: int,
        stream: AsyncIterator[tuple[int, RequestOutput]],
        choices: ChoiceChunks,
    ) -> AsyncIterator[str]:
        """Server-sent events for both streaming endpoints. For each output of each choice
        (index = prompt * n + sample), `choices(prompt, index, output, (text, tokens) already
        sent, first)` gives the choice chunks to send and whether they carry the output so far;
        then the usage chunk if asked for; an error as an error event; always `[DONE]` last."""
        sent: dict[int, tuple[int, int]] = {}  # index -> (characters, tokens) sent
        seen: set[int] = set()
        completion_tokens = 0
        try:
            async for i, out in stream:
                for comp in out.outputs:
                    index = i * req.n + comp.index
                    first = index not in seen
                    seen.add(index)
                    chunks, carried = choices(i, index, comp, sent.get(index, (0, 0)), first)
                    if carried:
                        sent[index] = (len(comp.text), len(comp.token_ids))
                        if comp.finished:
                            completion_tokens += len(comp.token_ids)
                    for chunk in chunks:
                        yield _sse({**head, "choices": [chunk]})
            if req.stream_options and req.stream_options.include_usage:
                yield _sse(
                    {**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}
                )
        except EngineDeadError as e:
            yield _sse(error_body(str(e), 503, "EngineDeadError"))
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
