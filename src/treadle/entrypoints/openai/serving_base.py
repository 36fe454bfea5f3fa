"""What both generating endpoints do with a request: check the model and the fields, build the
sampling parameters and prepare each prompt (`InputProcessor.prepare`: the one check against
the model in this process), run them, and wait for the end (a JSON body) or send it as it
comes (server-sent events: errors as error events, `[DONE]` last)."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from treadle.config import resolve_model
from treadle.entrypoints.openai.errors import APIError, error_body, error_for, is_bug
from treadle.entrypoints.openai.inputs import INLINE_CHARS, Prompt, PromptInputs, Truncation
from treadle.entrypoints.openai.params import AnyRequest, check_fields, sampling_params
from treadle.entrypoints.openai.protocol import StreamOptions, UsageInfo
from treadle.frontend.async_llm import AsyncLLM
from treadle.frontend.input_processor import PreparedRequest
from treadle.frontend.loras import FrontendLoRAs, LoRAModule
from treadle.logger import init_logger
from treadle.model.arch_files import read_arch
from treadle.outputs import CompletionOutput, RequestOutput
from treadle.sampling_params import SamplingParams, StructuredOutputsParams, generation_defaults
from treadle.validation import InvalidRequest, check_batch, check_max_tokens, is_int64, parse_int
from treadle.wire.engine import LoRARequest, MultiModalInput

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)

Outputs = AsyncIterator[tuple[int, RequestOutput]]
"""A request's outputs as they come: (prompt index, output), see `ServingBase.run`."""


class ServingBase:
    """The engine, the served names and the checks both endpoints share."""

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
        self.loras = FrontendLoRAs(
            tuple(LoRAModule(*m) for m in engine.config.frontend.lora_modules),
            self.listed_names,
            engine.config.lora is not None,
        )
        """The adapters a request's `model` may name (`frontend/loras.py`)."""
        if engine.config.lora is not None and self.loras.adapters:
            arch = read_arch(resolve_model(engine.config.model.model))
            self.loras.check_files(arch, engine.config.lora.max_lora_rank)
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

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 for a name not served."""
        lora = self.loras.resolve(model)
        if lora is not None or model is None or model in self.model_names:
            return lora
        names = [*self.listed_names, *self.loras.adapters]
        served = ", ".join(f"`{name}`" for name in names)  # as /v1/models
        message = f"The model `{model}` does not exist. This server serves {served}."
        raise APIError(message, 404, "NotFoundError", "model")

    def shown_model(self, lora: LoRARequest | None) -> str:
        """The name responses report: the adapter's, or the first served name."""
        return self.model_name if lora is None else lora.lora_name

    async def on_every_engine(self, method: str, args: list[Any]) -> None:
        """A utility call on every engine core; its refusal is the client's 400."""
        client = self.engine.client
        for rank in range(client.num_engines):
            try:
                await client.call_utility(method, *args, engine=rank)
            except RuntimeError as e:
                raise InvalidRequest("lora_path", str(e).split("InvalidRequest: ")[-1]) from None

    def check_without_prompt(self, req: AnyRequest) -> Truncation | None:
        """The request's checks that need no prompt; returns the truncation asked for."""
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

    def dp_rank(self, raw: Request) -> int | None:
        """The engine a client asks for with the `X-data-parallel-rank` header (as vLLM)."""
        value = raw.headers.get("X-data-parallel-rank")
        if value is None:
            return None
        return parse_int(value, "X-data-parallel-rank", 0, self.engine.client.num_engines - 1)

    async def prepare(
        self,
        req: AnyRequest,
        rid: str,
        max_tokens: int | None,
        prompts: list[Prompt],
        logprobs: int | None,
        prompt_logprobs: int | None,
        truncate: Truncation | None,
        tool_constraint: StructuredOutputsParams | None = None,
        embeds: list[torch.Tensor] | None = None,
        images: list[list[MultiModalInput]] | None = None,
        lora: LoRARequest | None = None,
    ) -> list[PreparedRequest]:
        """The request's `SamplingParams` (the HTTP rule first: prompt + max_tokens fit the
        context), and each prompt prepared with them as `{rid}-{i}`: checked once against the
        model (the engine core checks again), fanned out into its `n` samples, nothing sent.
        `tool_constraint` is the output a `tool_choice` forces; `embeds` are the tensors of
        the first prompts (given as `prompt_embeds`, their ids placeholders); `images` those
        of each prompt (its ids expanded). Raises `InvalidRequest`."""
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
        return await self.inputs.run(
            size,
            self._prepare,
            prompts,
            params,
            rid,
            req.priority,
            embeds or [],
            images or [],
            lora,
        )

    def _prepare(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        rid: str,
        priority: int,
        embeds: list[torch.Tensor],
        images: list[list[MultiModalInput]],
        lora: LoRARequest | None,
    ) -> list[PreparedRequest]:
        prepare = functools.partial(self.engine.input_processor.prepare, lora_request=lora)
        return [
            prepare(
                f"{rid}-{i}",
                text,
                ids,
                params,
                priority,
                embeds[i] if i < len(embeds) else None,
                images[i] if i < len(images) else None,
            )
            for i, (text, ids) in enumerate(prompts)
        ]

    async def run(self, requests: list[PreparedRequest], rank: int | None) -> Outputs:
        """Merge the output streams of several prompts: yields (prompt index, output)."""
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(i: int, request: PreparedRequest) -> None:
            try:
                async for out in self.engine.generate(request, rank):
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put(e)
                return
            await queue.put(None)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
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

    async def until_done(self, raw: Request, work: Any) -> JSONResponse:
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

    def stream(
        self, events: AsyncIterator[dict[str, Any]], outputs: Outputs, rid: str
    ) -> StreamingResponse:
        """`events` (an endpoint's chunks, made from `outputs`) as server-sent events."""
        return StreamingResponse(_sse(events, outputs, rid), media_type="text/event-stream")


async def _sse(
    events: AsyncIterator[dict[str, Any]], outputs: Outputs, rid: str
) -> AsyncIterator[str]:
    """Each event as a `data:` line; an error as an error event (the body an exception handler
    sends for it); always `[DONE]` last. Closing it closes `outputs` (their requests abort)."""
    try:
        async for event in events:
            yield _data(event)
    except Exception as e:
        if is_bug(e):  # the client still gets an error event and [DONE]
            logger.exception("Streaming request %s failed", rid)
        yield _data(error_for(e)[1])
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        await outputs.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class ChoiceProgress:
    """How much of one choice a stream has sent."""

    chars: int = 0
    """Characters of its text."""
    tokens: int = 0
    """Its tokens (what usage counts)."""
    started: bool = False
    """A chunk of it has been sent."""
    finished: bool = False
    """Its last chunk (with its finish_reason) has been sent: later outputs are skipped."""

    def new(self, comp: CompletionOutput) -> tuple[str, list[int]]:
        """The text and token ids of `comp` not sent yet."""
        return comp.text[self.chars :], comp.token_ids[self.tokens :]

    def sent(self, comp: CompletionOutput) -> None:
        """Chunks carrying `comp` so far are being sent."""
        self.chars, self.tokens = len(comp.text), len(comp.token_ids)
        self.started, self.finished = True, comp.finished


@dataclass(frozen=True)
class StreamUsage:
    """What a stream says about usage (`stream_options`): a last chunk with the totals
    (`include_usage`), and with `continuous_usage_stats` the usage so far in every chunk."""

    last: bool
    continuous: bool

    @classmethod
    def of(cls, options: StreamOptions | None) -> StreamUsage:
        last = options is not None and bool(options.include_usage)
        return cls(last, last and options is not None and bool(options.continuous_usage_stats))

    def so_far(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The `usage` field of a chunk (none without `continuous_usage_stats`)."""
        return {"usage": usage(prompt_tokens, completion_tokens)} if self.continuous else {}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    ).model_dump()


def logprob_work(outputs: Any) -> int:
    """How many tokens a response must write logprobs for (to decide on the thread pool)."""
    return sum(
        len(out.prompt_logprobs or ())
        + sum(sum(len(entry) for entry in comp.logprobs or ()) for comp in out.outputs)
        for out in outputs
    )
