"""Engine core <-> worker messages: one step's schedule (as a diff) and its sampled tokens, and
the calls that carry them (channel 3, ARCHITECTURE §4).

Workers keep each running request's state between steps, so `SchedulerOutput` carries new
requests in full and running ones only as deltas. A preempted request is dropped by the
workers and comes back later as a new request with all its tokens.

A call is `(method, args, kwargs, output_rank)` on the broadcast queue, and each rank that
replies puts `(method, ok, result or error text)` on its reply queue. On one host both are
pickles (ARCHITECTURE §4). A queue read on another host (Ray, `--nnodes`) carries msgpack,
never pickle (`WorkerCallCodec`, `WorkerReplyCodec`): a method's arguments and result decode
into the types of `CALL_TYPES` (plain data for a method it does not name, e.g. a user's
`collective_rpc`), so the messages are msgspec Structs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, TypeAlias

import msgspec
import numpy as np

from treadle.ipc.serial import (
    Array,  # a torch.Tensor or a numpy array
    Buffer,
    MsgpackDecoder,
    MsgpackEncoder,
    Tensor,  # torch.Tensor to msgspec, without importing torch
)
from treadle.ipc.shm_message import OOB_THRESHOLD, Codec, PickleCodec, own_first
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import Logprobs, LoRARequest, MultiModalInput


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    token_ids: list[int]  # prompt + output so far (outputs only after a preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    # A prompt given as embeddings ([num_prompt_tokens, hidden]): the model reads these rows
    # at the prompt's positions (its `token_ids` there are placeholders). Sent again in full
    # whenever the request is (after a preemption too).
    prompt_embeds: Tensor | None = None
    # The prompt's images (their pixels go again with every resend; the workers' encoder
    # cache, keyed by their hash, spares running the vision tower again).
    mm_inputs: list[MultiModalInput] | None = None
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Pipeline parallelism: the request's tokens sampled since the workers last heard of it
    # (only the last stage samples; the others learn them here, `core/pipeline.py`).
    new_token_ids: list[int] = msgspec.field(default_factory=list)


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    new_requests: list[NewRequestData] = msgspec.field(default_factory=list)
    cached_requests: list[CachedRequestData] = msgspec.field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_request_ids: set[str] = msgspec.field(default_factory=set)  # finished or preempted
    # Structured outputs: the constrained requests that sample in this step, and row i of
    # the int32 bitmask is the tokens request i may sample (`structured_outputs.fill_bitmask`:
    # a numpy array, so the engine core needs no torch; the torch runner wraps its rows).
    grammar_request_ids: list[str] = msgspec.field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: per request, the proposed tokens that follow its last token in
    # this step (its scheduled tokens are 1 + their number; `core/spec_decode.py`).
    spec_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    # Per request that reached the end of its tokens this step: the sampled token.
    sampled: dict[str, int] = msgspec.field(default_factory=dict)
    logprobs: dict[str, Logprobs] = msgspec.field(default_factory=dict)
    # Per request with `prompt_logprobs` whose prefill ran this step: (index in the prompt of
    # the first token scored, one row per scored prompt token).
    prompt_logprobs: dict[str, tuple[int, Logprobs]] = msgspec.field(default_factory=dict)
    # Per speculating request: the proposed tokens it accepted, which come before `sampled`.
    accepted: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Per pooling request whose prompt ended this step: its pooled hidden state (float32).
    pooled: dict[str, Array] = msgspec.field(default_factory=dict)
    # The vision encoder this step: images it encoded, images its cache answered, seconds.
    images_encoded: int = 0
    encoder_cache_hits: int = 0
    encoder_seconds: float = 0.0


WorkerCall: TypeAlias = tuple[str | None, tuple[Any, ...], dict[str, Any] | None, int | None]
"""(method, args, kwargs, output_rank); method None stops the worker (`STOP_WORKER`)."""

CALL_TYPES: dict[str, tuple[Any, Any]] = {
    "execute_model": (tuple[SchedulerOutput], ModelRunnerOutput),
    "add_lora": (tuple[LoRARequest], int),
}
"""Per method, the type its positional arguments and its result decode into; any other
method's decode as plain data (msgpack's: a tuple comes back a list)."""

_Envelope: TypeAlias = tuple[str | None, msgspec.Raw, msgspec.Raw, int | None]
_Reply: TypeAlias = tuple[str, bool, msgspec.Raw]


class _Typed:
    """One decoder per type, made on first use; all share the call's out-of-band frames."""

    def __init__(self) -> None:
        self._decoders: dict[Any, MsgpackDecoder] = {}

    def decode(self, t: Any, raw: msgspec.Raw, frames: Sequence[Any]) -> Any:
        decoder = self._decoders.get(t)
        if decoder is None:
            decoder = self._decoders[t] = MsgpackDecoder(t, allow_pickle=False)
        return decoder.decode([raw, *frames[1:]])  # frame indices are the message's own


class WorkerCallCodec:
    """The broadcast queue's codec: `WorkerCall`s as msgpack (`treadle.ipc.shm_message.Codec`)."""

    name: ClassVar[str] = "worker-call"
    cross_host: ClassVar[bool] = True

    def __init__(self) -> None:
        self._encoder = MsgpackEncoder(size_threshold=OOB_THRESHOLD, allow_pickle=False)
        self._envelope = msgspec.msgpack.Decoder(_Envelope)
        self._typed = _Typed()

    def dumps(self, call: WorkerCall) -> list[Buffer]:
        return self._encoder.encode(call)

    def release(self, bufs: list[Buffer]) -> None:
        pass

    def loads(self, bufs: Sequence[Any]) -> WorkerCall:
        frames = own_first(bufs)
        method, args, kwargs, output_rank = self._envelope.decode(frames[0])
        arg_type = CALL_TYPES[method][0] if method in CALL_TYPES else tuple[Any, ...]
        return (
            method,
            self._typed.decode(arg_type, args, frames),
            self._typed.decode(dict[str, Any] | None, kwargs, frames),
            output_rank,
        )


class WorkerReplyCodec:
    """A reply queue's codec: `(method, ok, result or error text)` as msgpack."""

    name: ClassVar[str] = "worker-reply"
    cross_host: ClassVar[bool] = True

    def __init__(self) -> None:
        self._encoder = MsgpackEncoder(size_threshold=OOB_THRESHOLD, allow_pickle=False)
        self._envelope = msgspec.msgpack.Decoder(_Reply)
        self._typed = _Typed()

    def dumps(self, reply: tuple[str, bool, Any]) -> list[Buffer]:
        return self._encoder.encode(reply)

    def release(self, bufs: list[Buffer]) -> None:
        pass

    def loads(self, bufs: Sequence[Any]) -> tuple[str, bool, Any]:
        frames = own_first(bufs)
        method, ok, result = self._envelope.decode(frames[0])
        if not ok:
            t: Any = str
        elif method in CALL_TYPES:
            t = CALL_TYPES[method][1]
        else:
            t = Any
        return method, ok, self._typed.decode(t, result, frames)


def call_codec(cross_host: bool) -> Codec:
    """The broadcast queue's codec: pickle (ARCHITECTURE §4) while every reader is on this
    host, msgpack when one is not."""
    return WorkerCallCodec() if cross_host else PickleCodec()


def reply_codec(cross_host: bool) -> Codec:
    """A reply queue's codec: pickle when its reader is on this host, else msgpack."""
    return WorkerReplyCodec() if cross_host else PickleCodec()


def reader_codec(handle_codec: str) -> Codec:
    """The codec that a worker queue's handle names (`Handle.codec`). A handle that names
    pickle is refused by a reader on another host (`MessageQueue.create_from_handle`)."""
    for codec in (WorkerCallCodec, WorkerReplyCodec, PickleCodec):
        if codec.name == handle_codec:
            return codec()
    raise ValueError(f"unknown worker queue codec {handle_codec!r}")
