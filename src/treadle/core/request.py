"""`Request`: the engine core's mutable record of one request while it is scheduled."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from treadle.ipc.serial import Tensor  # torch.Tensor, without importing torch
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import EngineCoreRequest, FinishReason, LoRARequest, MultiModalInput


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    client_index: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # kv_cache_manager.block_key
    grammar: Any = None  # the llguidance matcher of a structured-output request
    num_prompt_logprobs: int = 0  # prompt tokens whose logprobs were sent (`prompt_logprobs`)
    queued_ts: float = field(default_factory=time.monotonic)  # reached the engine core
    scheduled_ts: float | None = None  # first scheduled
    # The prompt as input embeddings ([num_prompt_tokens, hidden]); `prompt_token_ids` are
    # then placeholders (`treadle.prompt_embeds.placeholder_ids`).
    prompt_embeds: Tensor | None = None
    # The prompt's images (a vision-language model's), in prompt order.
    mm_inputs: list[MultiModalInput] | None = None
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    # Speculative decoding (`core/spec_decode.py`): its proposals' recent (decayed) hits and
    # trials, and steps since it last proposed while it could have.
    spec_hits: float = 0.0
    spec_trials: float = 0.0
    spec_idle: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        """A resumed request (its engine died) starts with the outputs it had, recomputed
        like a preempted one."""
        request = cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            client_index=req.client_index,
            num_prompt_logprobs=req.resumed_prompt_logprobs,
            prompt_embeds=req.prompt_embeds,
            mm_inputs=req.mm_inputs,
            lora_request=req.lora_request,
        )
        request.all_token_ids.extend(req.resumed_output_token_ids or ())
        return request

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    def embeds_bytes(self, start: int, end: int) -> bytes:
        """What a KV block of positions [start, end) holds besides its token ids: its adapter
        (a LoRA request's blocks are its adapter's alone), the bytes
        of the prompt embeddings there (with their dtype's name), and for each image whose
        placeholders reach into it, its hash and where it starts. Empty for positions of
        token ids alone."""
        out = (
            b"" if self.lora_request is None else f"lora:{self.lora_request.lora_int_id};".encode()
        )
        if self.mm_inputs and start < self.num_prompt_tokens:
            for mm in self.mm_inputs:
                if mm.offset < end and start < mm.offset + mm.length:
                    out += f"image:{mm.hash}@{mm.offset};".encode()
        if self.prompt_embeds is None or start >= self.num_prompt_tokens:
            return out
        import torch  # (a prompt of embeddings: the engine runs on PyTorch)

        rows = self.prompt_embeds[start:end].contiguous()
        return out + str(rows.dtype).encode() + rows.view(torch.uint8).numpy().tobytes()

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
