"""`SamplingParams`: how one request is sampled; validated on construction, sent on the wire."""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec

from treadle.config import ModelConfig, resolve_model
from treadle.validation import MIN_TEMPERATURE, check_sampling_params, is_finite


class StructuredOutputsParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A constraint on a request's output (vLLM's names): exactly one of `json` (a JSON
    schema, as a dict or its text), `regex`, `choice` (the output is one of these strings),
    `grammar` (Lark or GBNF), `json_object` (any JSON object) or `structural_tag` (its JSON
    text). Compiled by llguidance (`treadle.structured_outputs`); a grammar that does not
    compile is refused with the compiler's message."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        from treadle.validation import check_structured_outputs

        check_structured_outputs(self)
        if isinstance(self.json, dict) and not _msgpack_safe(self.json):
            # Its text from here on: msgpack cannot carry an int past 64 bits, JSON text can.
            self.json = json.dumps(self.json)

    @property
    def kind(self) -> str:
        """The one constraint given: "json", "regex", "choice", "grammar", ..."""
        return next(k for k in self.__struct_fields__ if getattr(self, k) not in (None, False))


def _msgpack_safe(value: Any) -> bool:
    """Whether msgpack can carry this JSON value: no int outside [-2**63, 2**64) (walked
    without recursion: a schema may nest deeper than Python's stack)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, int) and not -(2**63) <= item < 2**64:
            return False
    return True


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sampling settings of one request, with vLLM's names and defaults.

    Construction (and so decoding) checks every field with `validation.check_sampling_params`
    and raises `InvalidRequest` (a `ValueError`) naming the bad one. `top_k` 0 (or vLLM's -1)
    means "no top-k"; a temperature in (0, 0.01) is raised to 0.01, as vLLM does.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Appended fields (the wire is array-like: new fields only ever go last).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # The token ids of `bad_words` (each word with and without a leading space), set by the
    # front end's `InputProcessor`, which has the tokenizer; the engine core bans by these.
    bad_words_token_ids: list[list[int]] | None = None
    # llama.cpp's `infill` sampler after top-k/top-p/min-p (its /infill's plug-ins ask for it):
    # end the middle when end-of-generation tokens (eos and `stop_token_ids`) are likely,
    # merge tokens whose text starts another's, keep only the likely ones (worker/sampler.py).
    infill: bool = False
    # A pooling request (`/v1/embeddings`, `LLM.embed`): its prompt is read and no token is
    # sampled; it ends with the last prompt position's final hidden state ("last") or the
    # mean over all positions ("mean"), unnormalised (`EngineCoreOutput.pooled`).
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if is_finite(self.temperature) and 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        check_sampling_params(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes: object) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


# generation_config.json keys that are default sampling parameters (vLLM reads the same ones).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model: ModelConfig) -> dict[str, Any]:
    """The default sampling parameters of requests that set none (`--generation-config`):
    from the model's generation_config.json with `auto` (none when it has no such file), from
    the directory given, or none with `vllm`."""
    if model.generation_config == "vllm":
        return {}
    if model.generation_config == "auto":
        directory = resolve_model(model.model).directory
    else:
        directory = os.path.expanduser(model.generation_config)
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return {key: data[key] for key in GENERATION_CONFIG_KEYS if data.get(key) is not None}
