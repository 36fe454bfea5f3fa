"""Request and response bodies of the OpenAI-compatible API (pydantic), with vLLM's extras.

The models only parse types; the rules on values live in `treadle.validation`. The OpenAPI
schema still shows those rules (`_shown`), so clients and fuzzers see what is accepted; bounds
that depend on the running server (`x-limit`) are filled in by `fill_limits`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from treadle.sampling_params import SamplingParams
from treadle.validation import INT64_MAX, INT64_MIN, MAX_N, MAX_PROMPTS, MAX_STOP


def _shown(**schema: Any) -> Any:
    """Bounds shown in the OpenAPI schema only: `treadle.validation` checks them (once, for
    HTTP, the offline `LLM` and the engine core alike)."""
    return Field(json_schema_extra=schema)


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
    schema: Any, model: str, vocab_size: int, max_model_len: int, max_logprobs: int
) -> None:
    """Replace each `x-limit` marker of an OpenAPI schema by this server's bound, in place."""
    if isinstance(schema, list):
        for item in schema:
            fill_limits(item, model, vocab_size, max_model_len, max_logprobs)
        return
    if not isinstance(schema, dict):
        return
    limit = schema.pop("x-limit", None)
    if limit == "model":
        schema["enum"] = [model]
    elif limit is not None:
        schema["maximum"] = {
            "vocab_size": vocab_size - 1,
            "max_model_len": max_model_len - 1,
            "max_logprobs": min(max_logprobs, vocab_size),
        }[limit]
    for value in schema.values():
        fill_limits(value, model, vocab_size, max_model_len, max_logprobs)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class TextContentPart(OpenAIModel):
    """A part of a message's content; only text is supported (no images, no audio)."""

    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    """One chat message. Other fields (`tool_calls`, ...) reach the chat template as given."""

    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (as vLLM's "string" content format):
        text parts joined by newlines, no content as ""."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        else:
            message["content"] = self.content or ""
        return message


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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_SamplingFields):
    prompt: (
        str
        | Annotated[list[str], _shown(minItems=1, maxItems=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], _shown(minItems=1, maxItems=MAX_PROMPTS)]
    )
    max_tokens: MaxTokens | None = 16
    logprobs: NumLogprobs | None = None
    echo: bool = False


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], _shown(minItems=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None


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


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "treadle"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
