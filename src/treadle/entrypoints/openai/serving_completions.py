"""`POST /v1/completions`: prompts in (text or token ids, several at once, each with `n`
choices; with --enable-prompt-embeds also `prompt_embeds`, which come first, as vLLM's), a
`text_completion` body or its stream out; `echo` puts the prompt (and its logprobs) first, and
`max_tokens: 0` with `echo` scores the prompt alone."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from treadle.entrypoints.openai.beam_completions import beam_completion, wants_beam_search
from treadle.entrypoints.openai.fim import FimBudget, fim_prompt, find_fim_tokens, literal_ids
from treadle.entrypoints.openai.inputs import Prompt, Truncation
from treadle.entrypoints.openai.logprobs import LogprobWriter, padded, prompt_logprobs_json
from treadle.entrypoints.openai.protocol import CompletionRequest, now, random_id
from treadle.entrypoints.openai.serving_base import (
    ChoiceProgress,
    Outputs,
    ServingBase,
    StreamUsage,
    logprob_work,
    usage,
)
from treadle.outputs import CompletionOutput, RequestOutput
from treadle.prompt_embeds import placeholder_ids
from treadle.validation import InvalidRequest, check_prompt

if TYPE_CHECKING:
    import torch


class CompletionServing:
    def __init__(self, base: ServingBase):
        self.base = base

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        base = self.base
        if wants_beam_search(req):
            return await beam_completion(base, req, raw)
        lora = base.check_model(req.model)
        rank = base.dp_rank(raw)
        truncate = base.check_without_prompt(req)
        prompt_only = req.max_tokens == 0
        if prompt_only and not req.echo:
            raise InvalidRequest(
                "max_tokens", "must be at least 1 (0 only with echo, to score the prompt alone)"
            )
        embeds, prompts = await self._prompts(req, truncate)
        # With echo, the prompt's logprobs come first (vLLM's rule).
        prompt_lps = req.prompt_logprobs
        if prompt_lps is None and req.echo:
            prompt_lps = req.logprobs
        # The prompt alone still runs one token (the engine's rule), which is never shown.
        max_tokens = 1 if prompt_only else req.max_tokens
        rid = random_id("cmpl")
        requests = await base.prepare(
            req,
            rid,
            max_tokens,
            prompts,
            req.logprobs,
            prompt_lps,
            truncate,
            embeds=embeds,
            lora=lora,
        )
        writer = LogprobWriter(base.token_text, req.return_tokens_as_token_ids)
        job = _Completion(req, prompts, prompt_only, rid, base.shown_model(lora), writer)
        outputs = base.run(requests, rank)
        if req.stream:
            return base.stream(job.events(outputs), outputs, rid)
        return await base.until_done(raw, self._body(job, outputs))

    async def _prompts(
        self, req: CompletionRequest, truncate: Truncation | None
    ) -> tuple[list[torch.Tensor], list[Prompt]]:
        """(the `prompt_embeds` tensors, every prompt): those of the embeddings first, with
        placeholder ids (one per row), then those of `prompt` (none when it is "" or missing
        beside embeddings, as vLLM's)."""
        inputs = self.base.inputs
        embeds: list[torch.Tensor] = []
        if req.prompt_embeds is not None:
            embeds = await inputs.embeds_prompts(req.prompt_embeds, truncate)
            if req.echo:
                raise InvalidRequest(
                    "echo", "is not available with prompt_embeds: they have no text to echo"
                )
        if req.suffix:
            return [], await self._fim_prompts(req, truncate, bool(embeds))
        prompts: list[Prompt] = [(None, placeholder_ids(t.shape[0])) for t in embeds]
        if not embeds or req.prompt not in (None, ""):
            prompts += await inputs.completion_prompts(
                req.prompt, req.echo, truncate, req.add_special_tokens
            )
        return embeds, prompts

    async def _fim_prompts(
        self, req: CompletionRequest, truncate: Truncation | None, embeds: bool
    ) -> list[Prompt]:
        """With `suffix`: each prompt and the suffix as one fill-in-the-middle prompt, laid out
        as llama.cpp's /infill lays them out (no extra context, nothing cut)."""
        for name, given in (
            ("echo", req.echo),
            ("prompt_embeds", embeds),
            ("truncate_prompt_tokens", truncate),
        ):
            if given:
                raise InvalidRequest(name, "cannot be combined with suffix")
        prompt = req.prompt if req.prompt is not None else ""
        items: list[Any] = (
            [prompt]
            if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
            else list(prompt)
        )
        processor = self.base.engine.input_processor
        processor.check_chars(sum(len(i) for i in items) + len(req.suffix or ""))
        size = sum(len(i) for i in items) + len(req.suffix or "")
        return await self.base.inputs.run(size, self._fim_ids, items, req.suffix or "")

    def _fim_ids(self, items: list[Any], suffix: str) -> list[Prompt]:
        processor = self.base.engine.input_processor
        tokenizer = processor.tokenizer
        try:
            fim = find_fim_tokens(tokenizer)
        except InvalidRequest as e:
            raise e.renamed({"input_prefix": "suffix"}) from None
        limits = processor.limits
        budget = FimBudget(4 * limits.max_model_len, limits.max_model_len, 0)  # no cuts
        suffix_ids = literal_ids(tokenizer, suffix)
        out: list[Prompt] = []
        for item in items:
            prefix = literal_ids(tokenizer, item) if isinstance(item, str) else list(item)
            ids = fim_prompt(tokenizer, fim, prefix, suffix_ids, [], [], budget)
            check_prompt(ids, limits)
            out.append((None, ids))
        return out

    async def _body(self, job: _Completion, outputs: Outputs) -> dict[str, Any]:
        final: dict[int, RequestOutput] = {}
        async for i, out in outputs:
            final[i] = out
        return await self.base.inputs.run(logprob_work(final.values()), job.body, final)


@dataclass
class _Progress(ChoiceProgress):
    offset: int = 0
    """Characters of the choice's text sent, echo included (logprobs' `text_offset`)."""


@dataclass(frozen=True)
class _Completion:
    """One completion request, checked: how its outputs become a body or chunks."""

    req: CompletionRequest
    prompts: list[Prompt]
    prompt_only: bool
    """`max_tokens: 0`: the prompt is the answer; the token run for it is never shown."""
    rid: str
    model_name: str
    writer: LogprobWriter

    def body(self, final: dict[int, RequestOutput]) -> dict[str, Any]:
        """The response to the final outputs (prompt index -> output)."""
        req = self.req
        choices = []
        completion_tokens = 0
        for i in sorted(final):
            out, prompt_ids = final[i], self.prompts[i][1]
            for comp in out.outputs:
                text, ids, entries = self._echoed(self.prompts[i], out, comp)
                completion_tokens += len(comp.token_ids)
                choices.append(
                    {
                        "index": i * req.n + comp.index,
                        "text": text,
                        "logprobs": None
                        if req.logprobs is None
                        else self.writer.completion(ids, entries, req.logprobs, 0),
                        "finish_reason": comp.finish_reason,
                        "stop_reason": comp.stop_reason,
                        "prompt_logprobs": None
                        if req.prompt_logprobs is None
                        else prompt_logprobs_json(prompt_ids, out.prompt_logprobs),
                        # vLLM's `return_token_ids` (null when not asked for, as vLLM's)
                        "prompt_token_ids": list(prompt_ids) if req.return_token_ids else None,
                        "token_ids": list(comp.token_ids) if req.return_token_ids else None,
                    }
                )
        return {
            **self._head(),
            "choices": choices,
            "usage": usage(sum(len(ids) for _, ids in self.prompts), completion_tokens),
        }

    async def events(self, outputs: Outputs) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks: for each output of each choice (index = prompt * n + sample)
        that brings tokens or ends it, one chunk; then the usage chunk if asked for."""
        head, req = self._head(), self.req
        stream_usage = StreamUsage.of(req.stream_options)
        progress: dict[int, _Progress] = {}
        async for i, out in outputs:
            for comp in out.outputs:
                index = i * req.n + comp.index
                choice = progress.setdefault(index, _Progress())
                if choice.finished:
                    continue
                chunk = self._chunk(i, index, out, comp, choice)
                if chunk is not None:
                    prompt_tokens = len(self.prompts[i][1])
                    yield {
                        **head,
                        "choices": [chunk],
                        **stream_usage.so_far(prompt_tokens, choice.tokens),
                    }
        if stream_usage.last:
            prompt_tokens = sum(len(ids) for _, ids in self.prompts)
            completion_tokens = sum(choice.tokens for choice in progress.values())
            yield {**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}

    def _chunk(
        self, i: int, index: int, out: RequestOutput, comp: CompletionOutput, choice: _Progress
    ) -> dict[str, Any] | None:
        """The choice's chunk for `comp` (and `choice` moved on), or None if there is none yet."""
        req, first = self.req, not choice.started
        if first and req.echo:
            if not comp.token_ids and not comp.finished:
                return None  # the prompt's logprobs may not all be in yet
            text, ids, entries = self._echoed(self.prompts[i], out, comp)
        elif self.prompt_only:
            text, ids, entries = "", [], []
        else:
            text, ids = choice.new(comp)
            entries = list(comp.logprobs or ())[choice.tokens :]
        if not text and not ids and not comp.finished:
            return None  # as vLLM: a chunk per output that brings tokens, or the end
        chunk = {
            "index": index,
            "text": text,
            "logprobs": None
            if req.logprobs is None
            else self.writer.completion(ids, entries, req.logprobs, choice.offset),
            "finish_reason": comp.finish_reason,
            "stop_reason": comp.stop_reason,
        }
        if req.return_token_ids:  # vLLM's: the prompt's ids in each choice's first chunk
            chunk["prompt_token_ids"] = self.prompts[i][1] if first else None
            chunk["token_ids"] = comp.token_ids[choice.tokens :]
        choice.offset += len(text)
        choice.sent(comp)
        return chunk

    def _echoed(
        self, prompt: Prompt, out: RequestOutput, comp: CompletionOutput
    ) -> tuple[str, list[int], list[Any]]:
        """(text, token ids, logprob entries) of a choice: with echo, the prompt's first."""
        entries: list[Any] = list(comp.logprobs or ())
        if not self.req.echo:
            return comp.text, comp.token_ids, entries
        text, ids = prompt[0] or "", prompt[1]
        prompt_entries = padded(ids, out.prompt_logprobs)
        if self.prompt_only:
            return text, ids, prompt_entries
        return text + comp.text, [*ids, *comp.token_ids], [*prompt_entries, *entries]

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": now(),
            "model": self.model_name,
        }
