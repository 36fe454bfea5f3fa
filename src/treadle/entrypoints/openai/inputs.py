"""HTTP prompts -> token ids, off the event loop: completion prompts, chat messages, /tokenize
and /detokenize.

Lengths are checked first (characters before tokenizing, `validation.check_prompt` on the ids,
once per prompt: a prompt the model cannot take is refused before anything else is built; the
whole request is checked later, once, by `InputProcessor.prepare`), and work on large texts
runs in a small thread pool of this API server (Hugging Face tokenizers release the GIL), so
a huge prompt never stalls `/health` or other requests.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from treadle import envs
from treadle.config import FrontendConfig
from treadle.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ImagePart
from treadle.entrypoints.openai.tool_calls import template_messages
from treadle.frontend.images import ImageInputs, expand_placeholders
from treadle.frontend.input_processor import InputProcessor, message_chars
from treadle.frontend.media import MediaPolicy, load_image
from treadle.validation import InvalidRequest, check_batch, check_prompt, check_token_ids
from treadle.wire.engine import MultiModalInput

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

INLINE_CHARS = 4096
"""Text work on fewer characters than this runs inline: a thread hop would cost more."""

Prompt = tuple[str | None, list[int]]  # (text if any, token ids)
ChatPrompt = tuple[str | None, list[int], list[MultiModalInput]]  # and its images
Truncation = tuple[int, str]
"""(k, side): keep the last k prompt tokens ("left", vLLM's default) or the first k ("right")."""


def truncated(ids: list[int], truncate: Truncation | None) -> list[int]:
    """`ids` cut to `truncate` (vLLM's `truncate_prompt_tokens`), before any length check."""
    if truncate is None or len(ids) <= truncate[0]:
        return ids
    k, side = truncate
    return ids[:k] if side == "right" else ids[len(ids) - k :]


class PromptInputs:
    def __init__(self, processor: InputProcessor, frontend: FrontendConfig) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.frontend = frontend
        self.media_policy = MediaPolicy(
            allowed_local_path=frontend.allowed_local_media_path,
            allowed_domains=frontend.allowed_media_domains,
            allow_private_addresses=envs.media_allow_private_addresses(),
        )
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="treadle-text")

    async def run(self, size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, in the thread pool when `size` (characters or tokens) is
        large."""
        if size < INLINE_CHARS:
            return fn(*args, **kwargs)
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def embeds_prompts(self, data: Any, truncate: Truncation | None) -> list[torch.Tensor]:
        """The tensors of a completions request's `prompt_embeds` (one base64 string or a list
        of them), each read and checked by `InputProcessor.decode_embeds` (in the thread pool
        when large), cut to `truncate` rows and left room for an output. Raises `InvalidRequest` naming
        `prompt_embeds`, also when the server does not take them."""
        items = data if isinstance(data, list) else [data]
        if not items:
            raise InvalidRequest("prompt_embeds", "is empty")
        check_batch(len(items))
        size = sum(len(item) if isinstance(item, str) else 0 for item in items)
        tensors = await self.run(size, lambda: [self.processor.decode_embeds(i) for i in items])
        if truncate is not None:
            k, side = truncate
            tensors = [t[:k] if side == "right" else t[max(0, t.shape[0] - k) :] for t in tensors]
        for t in tensors:
            self.processor.check_embeds_length(t)
        return tensors

    async def completion_prompts(
        self,
        prompt: Any,
        echo: bool,
        truncate: Truncation | None = None,
        add_special_tokens: bool = True,
    ) -> list[Prompt]:
        """The prompts of a completions request, each cut to `truncate` tokens if asked and
        checked against the model. With `echo`, token-id prompts get their text too."""
        if prompt is None:
            raise InvalidRequest("prompt", "is missing: give a prompt (or prompt_embeds)")
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise InvalidRequest("prompt", "is empty")
        check_batch(len(items))
        limits = self.processor.limits
        for item in items:
            if isinstance(item, str):
                self.processor.check_chars(len(item))
            else:
                # cheap, and refuses huge id lists before decoding
                check_prompt(truncated(item, truncate), limits)
        size = sum(len(item) for item in items)
        return await self.run(
            size, self._completion_prompts, items, echo, truncate, add_special_tokens
        )

    def _completion_prompts(
        self, items: list[Any], echo: bool, truncate: Truncation | None, add_special: bool
    ) -> list[Prompt]:
        out: list[Prompt] = []
        for item in items:
            if isinstance(item, str):
                ids = self.processor.encode(item, add_special_tokens=add_special)
                text: str | None = item
                cut = truncated(ids, truncate)
                check_prompt(cut, self.processor.limits)  # (token ids were, before decoding)
            else:
                ids, text = list(item), None
                cut = truncated(ids, truncate)
            if len(cut) < len(ids) or (echo and text is None):
                text = self.tokenizer.decode(cut) if echo else None
            out.append((text, cut))
        return out

    async def chat_prompt(
        self,
        req: ChatCompletionRequest,
        truncate: Truncation | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> ChatPrompt:
        """The rendered chat (with `tools` given to the template), its token ids (cut to
        `truncate` tokens if asked), checked against the model, and its images (a
        vision-language model's: loaded, decoded and preprocessed in the thread pool, their
        placeholders expanded)."""
        if not req.messages:
            raise InvalidRequest("messages", "must not be empty")
        kwargs = dict(req.chat_template_kwargs or {})
        own_template = req.chat_template is not None or "chat_template" in kwargs
        if own_template and not self.frontend.trust_request_chat_template:
            raise InvalidRequest(
                "chat_template",
                "a request's own chat template is refused: start the server with "
                "--trust-request-chat-template to allow it",
            )
        image_inputs = self.processor.images
        messages, parts = self._messages(
            req.messages, kwargs.get("chat_template") or req.chat_template
        )
        self.processor.check_chars(message_chars(messages), "messages")
        pixels = await self._load_images(parts)
        size = message_chars(messages) + (INLINE_CHARS if own_template or tools else 0)
        text, ids = await self.run(
            size,
            self._render_and_encode,
            messages,
            req.add_generation_prompt,
            req.chat_template,
            kwargs,
            None if parts else truncate,
            req.add_special_tokens,
            tools,
        )
        if not parts or image_inputs is None:
            return text, ids, []
        ids, images = await self._in_pool(
            expand_placeholders, ids, pixels, image_inputs.vision, "messages"
        )
        if truncate is not None and len(ids) > truncate[0]:
            raise InvalidRequest("truncate_prompt_tokens", "cannot cut a prompt that holds images")
        check_prompt(ids, self.processor.limits)
        return text, ids, images

    def _messages(
        self, messages: list[ChatMessage], template: str | None
    ) -> tuple[list[dict[str, Any]], list[ImagePart]]:
        """The messages as the chat template sees them, and their image parts in order (a
        vision-language model's; for a text-only one an image part is refused)."""
        image_inputs = self.processor.images
        parts: list[ImagePart] | None = None if image_inputs is None else []
        placeholder = ""
        if image_inputs is not None:
            template = template or getattr(self.tokenizer, "chat_template", None)
            if not image_inputs.template_reads_parts(template):
                placeholder = image_inputs.placeholder
        dicts = template_messages(
            [m.template_dict(i, parts, placeholder) for i, m in enumerate(messages)]
        )
        return dicts, parts or []

    async def _load_images(self, parts: list[ImagePart]) -> list[torch.Tensor]:
        """The images' pixels, loaded and preprocessed in the thread pool (none: [])."""
        image_inputs = self.processor.images
        if not parts or image_inputs is None:
            return []
        image_inputs.check_count(len(parts), "messages", self.processor.max_model_len)
        return await self._in_pool(self._pixels, parts, image_inputs)

    def _pixels(self, parts: list[ImagePart], image_inputs: ImageInputs) -> list[torch.Tensor]:
        """Each image part loaded (`frontend/media.py`: the checks on hostile images) and
        made into the model's pixels."""
        policy = self.media_policy
        return [image_inputs.processor(load_image(p.url, policy, p.where)) for p in parts]

    async def _in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args)
        )

    def _render_and_encode(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template: str | None = None,
        kwargs: dict[str, Any] | None = None,
        truncate: Truncation | None = None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> Prompt:
        text = self.processor.render_chat(messages, add_generation_prompt, template, kwargs, tools)
        # The template already holds the special tokens: by default do not add them twice.
        ids = self.processor.encode(text, add_special_tokens=add_special_tokens, param="messages")
        cut = truncated(ids, truncate)
        check_prompt(cut, self.processor.limits)
        return (text if len(cut) == len(ids) else None), cut

    async def tokenize(
        self,
        prompt: str | None,
        messages: list[ChatMessage] | None,
        add_special_tokens: bool,
        add_generation_prompt: bool,
    ) -> list[int]:
        """/tokenize: a prompt or chat messages (with the model's template) -> token ids."""
        if messages is not None:
            dicts, parts = self._messages(messages, None)
            self.processor.check_chars(message_chars(dicts), "messages")
            pixels = await self._load_images(parts)
            size = message_chars(dicts)
            _, ids = await self.run(size, self._render_and_encode_any, dicts, add_generation_prompt)
            image_inputs = self.processor.images
            if image_inputs is not None:  # each image counts its tokens
                ids, _ = await self._in_pool(
                    expand_placeholders, ids, pixels, image_inputs.vision, "messages"
                )
            return ids
        if prompt is None:
            raise InvalidRequest("prompt", "give `prompt` or `messages`")
        self.processor.check_chars(len(prompt))
        return await self.run(len(prompt), self.processor.encode, prompt, add_special_tokens)

    def _render_and_encode_any(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool
    ) -> Prompt:
        """As `_render_and_encode`, but any length may be counted."""
        text = self.processor.render_chat(messages, add_generation_prompt)
        return text, self.processor.encode(text, add_special_tokens=False, param="messages")

    async def detokenize(self, tokens: list[int]) -> str:
        """/detokenize: token ids (each in the vocabulary) -> text."""
        return await self.run(len(tokens), self._decode, tokens)

    def _decode(self, tokens: list[int]) -> str:
        check_token_ids(tokens, len(self.tokenizer), "tokens")
        return str(self.tokenizer.decode(tokens))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
