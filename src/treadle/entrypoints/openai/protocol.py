"""Request and response bodies of the OpenAI-compatible API (pydantic), with vLLM's extras.

The models only parse types; the rules on values live in `treadle.validation`. The OpenAPI
schema still shows those rules (`_shown`), so clients and fuzzers see what is accepted; bounds
that depend on the running server (`x-limit`) are filled in by `fill_limits`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from treadle.validation import (
    INT64_MAX,
    INT64_MIN,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP,
    InvalidRequest,
)


def _shown(**schema: Any) -> Any:
    """Bounds shown in the OpenAPI schema only: `treadle.validation` checks them (once, for
    HTTP, the offline `LLM` and the engine core alike)."""
    return Field(json_schema_extra=schema)


_EMBEDS_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "format": "byte"},
        {
            "type": "array",
            "items": {"type": "string", "format": "byte"},
            "minItems": 1,
            "maxItems": MAX_PROMPTS,
        },
        {"type": "null"},
    ]
}

Int64 = Annotated[int, _shown(minimum=INT64_MIN, maximum=INT64_MAX)]
Count = Annotated[int, _shown(minimum=0, maximum=INT64_MAX)]
TokenId = Annotated[int, _shown(minimum=0, **{"x-limit": "vocab_size"})]
MaxTokens = Annotated[int, _shown(minimum=1, **{"x-limit": "max_model_len"})]
NumLogprobs = Annotated[int, _shown(minimum=0, **{"x-limit": "max_logprobs"})]
ModelName = Annotated[str, _shown(**{"x-limit": "model"})]
Penalty = Annotated[float, _shown(minimum=-2.0, maximum=2.0)]
Probability = Annotated[float, _shown(minimum=0.0, maximum=1.0)]
TokenIds = Annotated[list[TokenId], _shown(minItems=1)]


def fill_limits(
    schema: Any, models: Sequence[str], vocab_size: int, max_model_len: int, max_logprobs: int
) -> None:
    """Replace each `x-limit` marker of an OpenAPI schema by this server's bound, in place
    (`models`: every name the model answers to)."""
    if isinstance(schema, list):
        for item in schema:
            fill_limits(item, models, vocab_size, max_model_len, max_logprobs)
        return
    if not isinstance(schema, dict):
        return
    limit = schema.pop("x-limit", None)
    if limit == "model":
        schema["enum"] = list(models)
    elif limit is not None:
        schema["maximum"] = {
            "vocab_size": vocab_size - 1,
            "max_model_len": max_model_len - 1,
            "max_logprobs": min(max_logprobs, vocab_size),
        }[limit]
    for value in schema.values():
        fill_limits(value, models, vocab_size, max_model_len, max_logprobs)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
"""Content part types that are text (OpenAI's and the Responses API's), and their text key."""


class ContentPart(OpenAIModel):
    """A part of a message's content: text (see `TEXT_PARTS`), or for a vision-language model
    an image (`{"type": "image_url", "image_url": {"url": ...}}`); an audio, video or file
    part is refused."""

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None


class ImageURL(OpenAIModel):
    """An image part's image: a `data:image/...;base64,` URI, a `file://` path or an
    `http(s)://` URL (`frontend/media.py` says which are taken); `detail` only "auto"."""

    url: str
    detail: str | None = None


class ChatMessage(OpenAIModel):
    """One chat message. Other fields (`tool_calls`, `tool_call_id`, ...) reach the chat
    template as given."""

    role: str
    content: str | list[str | ContentPart] | None = None
    name: str | None = None

    def template_dict(
        self, index: int = 0, images: list[ImagePart] | None = None, placeholder: str = ""
    ) -> dict[str, Any]:
        """The message as the chat template sees it; see `template_message`."""
        return template_message(self.model_dump(exclude_none=True), index, images, placeholder)


@dataclass(frozen=True)
class ImagePart:
    """An image part of a chat: its URL and where it was (for errors)."""

    url: str
    where: str


def template_message(
    message: dict[str, Any],
    index: int = 0,
    images: list[ImagePart] | None = None,
    placeholder: str = "",
) -> dict[str, Any]:
    """A chat message as the template sees it. Text only (`images` None): vLLM's "string"
    content format, the text of its content parts joined by newlines, no content as "", and
    `InvalidRequest` for a part that is not text (`index` is the message's place, for the
    error). For a model that takes images, each `image_url` part is appended to `images`
    and the template sees it as `{"type": "image"}` among `{"type": "text", "text": ...}`
    parts (no `placeholder`: the template reads parts and writes the image token itself,
    vLLM's "openai" format) or as `placeholder` (the image token's text) on a line of its
    own among the text (a template that reads strings)."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return {**message, "content": content or ""}
    if not isinstance(content, list):
        raise InvalidRequest(
            "messages", f"content must be a string or a list of parts (message {index})"
        )
    texts: list[str | None] = []  # None: an image's place
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url" and images is not None:
            images.append(_image_part(part, f"messages[{index}].content[{j}].image_url"))
            texts.append(None)
            continue
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            what = "text or image_url" if images is not None else "text only"
            raise InvalidRequest(
                "messages",
                f"may hold {what}: this model takes no {kind!r} content (message {index}, "
                f"part {j}; text parts are of type {', '.join(sorted(TEXT_PARTS))})",
            )
        text = part.get(key)
        if not isinstance(text, str):
            raise InvalidRequest(
                "messages", f"content parts need a string {key!r} (message {index}, part {j})"
            )
        texts.append(text)
    if images is None:
        return {**message, "content": "\n".join(t for t in texts if t is not None)}
    if not placeholder:
        listed = [{"type": "image"} if t is None else {"type": "text", "text": t} for t in texts]
        return {**message, "content": listed}
    return {**message, "content": "\n".join(placeholder if t is None else t for t in texts)}


def _image_part(part: dict[str, Any], where: str) -> ImagePart:
    """An `image_url` part's URL: `{"url": ..., "detail": "auto"}` or the URL itself."""
    value = part.get("image_url")
    if isinstance(value, str):
        return ImagePart(value, where)
    if not isinstance(value, dict) or not isinstance(value.get("url"), str):
        raise InvalidRequest(where, 'needs {"url": "data:image/...;base64,..." or a URL}')
    detail = value.get("detail", "auto")
    if detail not in ("auto", None):
        raise InvalidRequest(
            f"{where}.detail",
            f"{detail!r} is not available: this model sees every image at its one size "
            '(give "auto" or leave it out)',
        )
    other = sorted(set(value) - {"url", "detail"})
    if other:
        raise InvalidRequest(where, f"has fields this server does not take: {', '.join(other)}")
    return ImagePart(value["url"], where)


class JsonSchemaFormat(OpenAIModel):
    """OpenAI's `response_format.json_schema`: the schema is under `schema`."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format` (and vLLM's `structural_tag` kind, its other fields kept)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs`: one of these constraints (`json` as a schema object or its
    text)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class _SamplingFields(OpenAIModel):
    """Fields shared by completions and chat; None means "not given"."""

    model: ModelName | None = None
    n: Annotated[int, _shown(minimum=1, maximum=MAX_N)] = 1
    temperature: Annotated[float, _shown(minimum=0.0)] | None = None
    top_p: Annotated[float, _shown(exclusiveMinimum=0.0, maximum=1.0)] | None = None
    stop: (
        str | Annotated[list[Annotated[str, _shown(minLength=1)]], _shown(maxItems=MAX_STOP)] | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Int64 | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Annotated[int, _shown(minimum=-1, maximum=INT64_MAX)] | None = None
    min_p: Probability = 0.0
    repetition_penalty: Annotated[float, _shown(exclusiveMinimum=0.0)] = 1.0
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], _shown(maxItems=MAX_STOP)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    logit_bias: dict[str, Annotated[float, _shown(minimum=-100, maximum=100)]] | None = None
    allowed_token_ids: Annotated[list[TokenId], _shown(minItems=1)] | None = None
    bad_words: Annotated[list[str], _shown(maxItems=MAX_STOP)] | None = None
    prompt_logprobs: NumLogprobs | None = None
    # vLLM's: keep the last k prompt tokens (-1: as many as the model takes)
    truncate_prompt_tokens: Annotated[int, _shown(minimum=-1, maximum=INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None  # left (the default) keeps the last
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for `structured_outputs` (deprecated there, mapped onto it here)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # llama.cpp's name: a GBNF (or Lark) grammar, the same as `structured_outputs.grammar`
    grammar: str | None = None
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:{id}"
    # vLLM's: the prompt's and each choice's token ids in the response (and its stream)
    return_token_ids: bool | None = None


class CompletionRequest(_SamplingFields):
    # None (or "") only with `prompt_embeds` (vLLM's rule)
    prompt: (
        str
        | Annotated[list[str], _shown(minItems=1, maxItems=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], _shown(minItems=1, maxItems=MAX_PROMPTS)]
        | None
    ) = None
    # vLLM's: base64 of `torch.save` of a [tokens, hidden_size] float tensor, or a list of
    # them (with --enable-prompt-embeds); read and checked by `InputProcessor.decode_embeds`,
    # so any other JSON is a 400 naming this field too
    prompt_embeds: Annotated[Any, Field(json_schema_extra=_EMBEDS_SCHEMA)] = None
    # 0 only with `echo`: score the prompt, return no new tokens (vLLM's)
    max_tokens: Annotated[int, _shown(minimum=0, **{"x-limit": "max_model_len"})] | None = 16
    logprobs: NumLogprobs | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: BOS and the like on text prompts
    # OpenAI's insert mode: the text after the completion; the prompt and it become a
    # fill-in-the-middle prompt as llama.cpp lays one out (a model without FIM tokens: a 400)
    suffix: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], _shown(minItems=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM's: on top of those the template writes
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's tool calling (checked and planned by `tool_calls.plan_tools`)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call per choice
    include_reasoning: bool = True  # vLLM's: false drops --reasoning-parser's reasoning


class TokenizeRequest(OpenAIModel):
    model: ModelName | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: ModelName | None = None
    tokens: list[TokenId]


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ModelPermission(OpenAIModel):
    """vLLM's (from OpenAI's old API): what a client may do with the model."""

    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIModel):
    """A served model as vLLM describes it; `root` is the first served name, never a path
    that the client did not give."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "treadle"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
