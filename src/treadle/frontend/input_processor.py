"""Prompts in: text, token ids or chat messages -> a `PreparedRequest` (truncated, checked
once against the model, fanned out into its `n` samples), for the HTTP server and the offline
`LLM` alike.

`prepare` is this process's one run of `validation.check_request` for a prompt (the engine core
runs it again: its socket is untrusted). Text is measured before it is tokenized or rendered: a
prompt longer than `max_prompt_chars` is refused without the cost of tokenizing it. The methods
are synchronous; the HTTP server calls the heavy ones (`encode`, `render_chat`, `prepare` of a
constrained request) from a thread pool.

A prompt may also be rows of input embeddings (`prompt_embeds`, with --enable-prompt-embeds):
`decode_embeds` reads a client's base64 (without unpickling: `treadle.prompt_embeds`),
`check_embeds` checks a tensor given offline; `prepare` then gives the request placeholder
token ids (one per row) and sends the tensor along to the engine cores.

A vision-language model's prompt may carry images (`frontend/images.py`: its placeholders are
expanded to one token per feature row before `prepare`, which sends the pixels along).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from treadle import prompt_embeds as embeds_format
from treadle.frontend.images import ImageInputs, collapse_placeholders, expand_placeholders
from treadle.frontend.output_processor import child_params, child_request_ids
from treadle.sampling_params import SamplingParams
from treadle.structured_outputs import GrammarCompiler
from treadle.validation import InvalidRequest, ModelLimits, check_request
from treadle.wire.engine import EngineCoreRequest, LoRARequest, MultiModalInput

if TYPE_CHECKING:
    import torch  # only prompt_embeds and images need it: imported by what reads them

PromptType = str | dict[str, Any] | list[int]

# Parameters of `apply_chat_template` itself: a client's `chat_template_kwargs` may not set them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def longest_token_chars(tokenizer: Any) -> int:
    """Characters in the vocabulary's longest token string. A token covers at most that many
    characters of the text, so a text longer than `n` times this cannot fit in `n` tokens."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if t), default=1)


def message_chars(messages: Sequence[dict[str, Any]]) -> int:
    """Characters in the text of chat messages (string values, and those of content parts)."""
    total = 0
    for message in messages:
        for value in message.values():
            if isinstance(value, str):
                total += len(value)
            elif isinstance(value, list):
                for part in value:
                    if isinstance(part, dict):
                        total += sum(len(v) for v in part.values() if isinstance(v, str))
    return total


@dataclass(frozen=True)
class PreparedRequest:
    """One prompt's request, ready to send: what the output processor tracks (`request_id`,
    `prompt`, `prompt_token_ids`, `params`) and what the engine cores get (`children`: one
    `EngineCoreRequest` per sample, `"{i}_{request_id}"` when `n` > 1)."""

    request_id: str
    prompt: str | None
    """The prompt's text, None when it was given as ids or truncation cut it."""
    prompt_token_ids: list[int]
    """As truncated by `params.truncate_prompt_tokens`."""
    params: SamplingParams
    children: list[EngineCoreRequest]
    prompt_embeds: torch.Tensor | None = None
    """The prompt's embeddings (then `prompt_token_ids` are placeholders, one per row)."""

    @property
    def shown_prompt_token_ids(self) -> list[int]:
        """The prompt's token ids as outputs report them: none for an embeddings prompt."""
        return [] if self.prompt_embeds is not None else self.prompt_token_ids


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        limits: ModelLimits,
        max_prompt_chars: int | None = None,
        client_index: int = 0,
        hidden_size: int | None = None,
        images: ImageInputs | None = None,
    ) -> None:
        """`client_index`: the front end whose sockets the engine cores answer these requests
        on (an API server's rank among several; 0 otherwise). `hidden_size`: the model's, when
        prompt embeddings are accepted (--enable-prompt-embeds); None refuses them. `images`:
        a vision-language model's (None: images are refused)."""
        self.tokenizer = tokenizer
        self.images = images
        self.hidden_size = hidden_size
        self.limits = limits
        self.client_index = client_index
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self._grammars: GrammarCompiler | None = None
        self.max_prompt_chars = (
            max_prompt_chars
            if max_prompt_chars is not None
            else limits.max_model_len * longest_token_chars(tokenizer)
        )

    def check_chars(self, num_chars: int, param: str = "prompt") -> None:
        if num_chars > self.max_prompt_chars:
            raise InvalidRequest(
                param,
                f"has {num_chars} characters, more than this server takes "
                f"({self.max_prompt_chars}; see --max-prompt-chars)",
            )

    def encode(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        """Token ids of `text`, after checking its length in characters."""
        self.check_chars(len(text), param)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids) for any accepted prompt form."""
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.encode(prompt["prompt"])
            raise InvalidRequest("prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequest("prompt", f"has an unsupported type {type(prompt).__name__}")

    def decode_embeds(self, data: str) -> torch.Tensor:
        """The tensor of one client's `prompt_embeds` (base64 of `torch.save`), checked; raises
        `InvalidRequest` naming `prompt_embeds` (also when they are not enabled)."""
        return embeds_format.decode(data, self._embeds_width(), self.max_model_len)

    def check_embeds(self, tensor: object) -> torch.Tensor:
        """An offline `{"prompt_embeds": tensor}`: on the CPU, contiguous, checked as
        `decode_embeds` checks. Raises `InvalidRequest`."""
        import torch

        width = self._embeds_width()
        if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
            tensor = tensor.detach().cpu().contiguous()
        return embeds_format.check_tensor(tensor, width, self.max_model_len)

    def check_embeds_length(self, embeds: torch.Tensor) -> None:
        """Embeddings (after any truncation) that leave room for an output token."""
        if embeds.shape[0] >= self.max_model_len:
            raise InvalidRequest(
                embeds_format.PARAM,
                f"have {embeds.shape[0]} rows, but this model's maximum context length is "
                f"{self.max_model_len} tokens (with room for at least one output token)",
            )

    def _embeds_width(self) -> int:
        if self.hidden_size is None:
            raise embeds_format.disabled()
        return self.hidden_size

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat as prompt text, `tools` (OpenAI tool definitions) given to the template.
        `chat_template` replaces the model's own (whether a client may send one is the
        caller's policy). Raises `InvalidRequest`."""
        self.check_chars(message_chars(messages), "messages")
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise InvalidRequest(
                "chat_template_kwargs", f"may not set {', '.join(reserved)} (request fields)"
            )
        template = kwargs.pop("chat_template", None) or chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(
                "messages", "this model's tokenizer has no chat template; use a plain prompt"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **kwargs,
            )
        except Exception as e:  # a template may raise anything on odd messages
            raise InvalidRequest(
                "messages", f"cannot apply the chat template: {type(e).__name__}: {e}"
            ) from e
        text = str(text)
        self.check_chars(len(text), "messages")
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """`render_chat` with the template's extra variables as keyword arguments."""
        template = kwargs.pop("chat_template", None)
        return self.render_chat(messages, add_generation_prompt, template, kwargs)

    def prepare(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        prompt_embeds: torch.Tensor | None = None,
        mm_inputs: list[MultiModalInput] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> PreparedRequest:
        """The request of one prompt: cut to `params.truncate_prompt_tokens` (its text dropped
        if that cut it), checked once against the model (`_check`), and fanned out into its
        `n` samples (`child_params`: the check covers them, they differ only in the seed and
        in who scores the prompt). Sends nothing; raises `InvalidRequest` naming the field.
        With `prompt_embeds` (checked by `decode_embeds` or `check_embeds`), the embeddings are
        the prompt (cut to their last rows the same way) and `prompt_token_ids` is ignored.
        `mm_inputs`: the prompt's images (its ids already expanded: `ImageInputs.prompt`);
        such a prompt is never cut. `lora_request`: the adapter it runs with."""
        if prompt_embeds is not None:
            prompt_embeds = self._embeds_prompt(prompt_embeds, params)
            prompt_token_ids = embeds_format.placeholder_ids(prompt_embeds.shape[0])
        if self.images is not None and not mm_inputs:
            expand_placeholders(prompt_token_ids, [], self.images.vision, "prompt")
        ids = self.truncate(prompt_token_ids, params)
        if len(ids) < len(prompt_token_ids):
            if mm_inputs:
                raise InvalidRequest(
                    "truncate_prompt_tokens", "cannot cut a prompt that holds images"
                )
            prompt = None  # the text no longer matches the tokens
        self._check(ids, params, priority)
        now = time.time()
        wire_ids = collapse_placeholders(ids, mm_inputs) if mm_inputs else ids
        children = [
            EngineCoreRequest(
                request_id=child_id,
                prompt_token_ids=wire_ids,
                sampling_params=child_params(params, index),
                eos_token_id=self.eos_token_id,
                arrival_time=now,
                priority=priority,
                client_index=self.client_index,
                prompt_embeds=prompt_embeds,
                mm_inputs=mm_inputs or None,
                lora_request=lora_request,
            )
            for index, child_id in enumerate(child_request_ids(request_id, params.n))
        ]
        return PreparedRequest(request_id, prompt, ids, params, children, prompt_embeds)

    def _embeds_prompt(self, embeds: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Embeddings cut to `truncate_prompt_tokens` rows, that leave room for an output and
        ask for nothing an embeddings prompt lacks (its tokens: prompt logprobs)."""
        k = params.truncate_prompt_tokens
        if k is not None and embeds.shape[0] > k:
            embeds = embeds[embeds.shape[0] - k :]
        self.check_embeds_length(embeds)
        if params.prompt_logprobs is not None:
            raise InvalidRequest(
                "prompt_logprobs",
                "are not available for prompt_embeds: such a prompt has no tokens to score",
            )
        return embeds

    @staticmethod
    def truncate(prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (vLLM's rule), or all of it."""
        k = params.truncate_prompt_tokens
        if k is None or len(prompt_token_ids) <= k:
            return prompt_token_ids
        return prompt_token_ids[-k:]

    def _check(self, prompt_token_ids: list[int], params: SamplingParams, priority: int) -> None:
        """`validation.check_request` against this model, then the parts that need the
        tokenizer: `bad_words` become `params.bad_words_token_ids`, and a structured-output
        constraint must compile. Raises `InvalidRequest`."""
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        check_request(prompt_token_ids, params, self.limits, self.eos_token_id, priority)
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this tokenizer (built on the first constrained request)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_id)
        return self._grammars

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's token ids alone and after a space (as vLLM): both spellings a model
        may produce. (The space's own token is dropped when the tokenizer gives it apart.)"""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
                if ids and ids not in out:
                    out.append(ids)
        return out
