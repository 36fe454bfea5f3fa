"""Front end <-> engine core messages: msgspec Structs, array-like, fields only ever appended."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from treadle.ipc.serial import (  # to msgspec, without importing torch
    Array,  # a torch.Tensor or a numpy array
    Tensor,  # a torch.Tensor
)
from treadle.sampling_params import SamplingParams


class EngineCoreRequestType(enum.Enum):
    """The type byte that leads every front end -> engine core message (after the identity)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    # Internal sentinels, never sent by a front end.
    EXECUTOR_FAILED = b"\x04"  # the executor or an IO thread failed: (reason or exception)
    FRONTEND_GONE = b"\x05"  # the front end of another host disconnected: (reason)
    REFUSE = b"\x06"  # an ADD that did not decode: (request_id, client_index, reason)
    FRONTEND_DROPPED = b"\x07"  # a local front end's request socket dropped: (client_index)


class FinishReason(enum.IntEnum):
    """Why a request ended; `str()` gives the OpenAI spelling. ERROR (as vLLM's): the engine
    refused or could not run the request; `stop_reason` then carries the message."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class MultiModalInput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One image of a prompt: its preprocessed pixels ([3, S, S], out of band), the place of
    its `length` placeholder tokens in the prompt (from `offset`), and the hash of its pixels,
    which keys the encoder's cache and the prompt's KV blocks (`core/request.py`)."""

    pixel_values: Tensor
    offset: int
    length: int
    hash: str


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's `LoRARequest`: a LoRA adapter by its name, its id (unique among the server's
    adapters; the engine and the prefix cache know it by this) and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    prompt_embeds: Tensor | None = None
    # A request resumed on a new engine core after its engine died (the front end's
    # `frontend/inflight.py`): the output tokens its client received before the death (they
    # count as outputs: max_tokens, penalties, stop rules and grammars see them; a seeded
    # request's generator skips their draws), and how many prompt-logprob rows it received.
    resumed_output_token_ids: list[int] | None = None
    resumed_prompt_logprobs: int = 0
    # The prompt's images, in prompt order (a vision-language model's; `MultiModalInput`).
    # On the wire `prompt_token_ids` holds each image as one image token, which the engine
    # core expands to the image's `length` (`core/prompt_inputs.py`: the seed's message stays small);
    # offsets count positions of the expanded prompt.
    mm_inputs: list[MultiModalInput] | None = None
    # The LoRA adapter the request runs with (None: the base model).
    lora_request: LoRARequest | None = None


class Logprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprobs of a run of tokens (sampled, or the prompt's): per token, entry 0 is that
    token, then the top-n by rank; `ranks` is entry 0's rank (1 = most likely)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Logprobs of the prompt tokens this step's prefill chunk scored (`prompt_logprobs`): one
    # row per prompt token from the second on, in order, across the request's chunks.
    new_prompt_logprobs: Logprobs | None = None
    # On the output that carries a request's first token: seconds it waited before it was
    # first scheduled, and from then to its first token (the engine core's clock).
    queue_time: float = 0.0
    prefill_time: float = 0.0
    # A pooling request's result (its last output): float32 [hidden_size], out of band.
    pooled: Array | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Speculative decoding (vLLM's spec_decode_* counters): verifying steps, tokens proposed,
    # tokens accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # Accepted proposals by their position in the proposal (0 .. k-1).
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # A vision-language model's encoder (totals): images its vision tower encoded, images
    # its cache answered instead, seconds encoding.
    mm_images_encoded: int = 0
    mm_encoder_cache_hits: int = 0
    mm_encoder_seconds: float = 0.0


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    failure_message: str | None = None
    result: Any = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None


class DPStats(msgspec.Struct, array_like=True, gc=False):
    """DP coordinator -> front ends: each engine's `[waiting, running, kv_usage]` and the wave."""

    engines: list[list[float]]
    wave: int
    wave_running: bool


class StartDPWave(msgspec.Struct, array_like=True, gc=False):
    """DP coordinator -> engines: wave `wave` has started; `exclude` started it itself."""

    wave: int
    exclude: int


def add_request_identity(payload: bytes | memoryview) -> tuple[str, int] | None:
    """(request_id, client_index) of an ADD payload that did not decode as an
    `EngineCoreRequest` (e.g. out-of-range sampling params), when it holds them, so that the
    engine core can still refuse that request (`EngineCore.refuse`) instead of leaving its
    sender waiting."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError):
        return None
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        return None
    client_index = raw[5] if len(raw) > 5 else 0  # array-like: trailing defaults are omitted
    if not isinstance(client_index, int) or isinstance(client_index, bool):
        return None
    return raw[0], client_index
