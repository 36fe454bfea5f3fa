"""treadle.ipc.serial: msgpack wire format with out-of-band tensors and arrays."""

from __future__ import annotations

import contextlib
import random
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from treadle.ipc.serial import DecodeError, MsgpackDecoder, MsgpackEncoder
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    SchedulerStats,
    UtilityOutput,
)

pytestmark = pytest.mark.timeout(60)


def roundtrip(obj: Any, t: Any = Any, encoder: MsgpackEncoder | None = None) -> Any:
    bufs = (encoder or MsgpackEncoder()).encode(obj)
    return MsgpackDecoder(t).decode(bufs)


def request(**changes: Any) -> EngineCoreRequest:
    fields: dict[str, Any] = dict(
        request_id="cmpl-1",
        prompt_token_ids=list(range(128)),
        sampling_params=SamplingParams(temperature=0.5, top_k=20, stop=["\n"], seed=7),
        eos_token_id=2,
        arrival_time=time.time(),
        client_index=1,
        current_wave=3,
        priority=-1,
    )
    fields.update(changes)
    return EngineCoreRequest(**fields)


def outputs() -> EngineCoreOutputs:
    logprobs = Logprobs(token_ids=[[5, 6, 7]], logprobs=[[-0.1, -2.5, -3.0]], ranks=[1])
    return EngineCoreOutputs(
        engine_index=1,
        outputs=[
            EngineCoreOutput("a", [5], new_logprobs=logprobs),
            EngineCoreOutput("b", [9, 10], finish_reason=FinishReason.STOP, stop_reason="\n"),
            EngineCoreOutput("c", [], finish_reason=FinishReason.LENGTH, num_cached_tokens=32),
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25),
        timestamp=123.5,
        utility_output=UtilityOutput(call_id=4, result={"blocks": 100}),
        finished_requests={"b", "c"},
        wave_complete=2,
        start_wave=3,
    )


@pytest.mark.parametrize(
    "obj,t",
    [
        (request(), EngineCoreRequest),
        (request(prompt_embeds=torch.randn(16, 64)), EngineCoreRequest),
        (outputs(), EngineCoreOutputs),
        (EngineCoreOutputs(), EngineCoreOutputs),
        (EngineCoreOutput("x", [1, 2, 3]), EngineCoreOutput),
        (UtilityOutput(call_id=1, failure_message="boom"), UtilityOutput),
        (SchedulerStats(num_waiting_reqs=5, prefix_cache_hits=3), SchedulerStats),
        (Logprobs(token_ids=[[1]], logprobs=[[0.0]], ranks=[1]), Logprobs),
        (SamplingParams(n=2, logprobs=5, stop_token_ids=[7]), SamplingParams),
        ({"plain": [1, 2.5, "three", None, b"four"]}, Any),
    ],
)
def test_wire_types_round_trip(obj: Any, t: Any) -> None:
    got = roundtrip(obj, t)
    assert type(got) is type(obj)
    if isinstance(obj, EngineCoreRequest) and obj.prompt_embeds is not None:
        assert torch.equal(got.prompt_embeds, obj.prompt_embeds)
        got.prompt_embeds = obj.prompt_embeds = None
    assert got == obj


def test_finish_reason_and_sets_keep_their_types() -> None:
    got = roundtrip(outputs(), EngineCoreOutputs)
    assert got.outputs[1].finish_reason is FinishReason.STOP
    assert str(got.outputs[1].finish_reason) == "stop"
    assert got.finished_requests == {"b", "c"}


def test_small_tensor_travels_inline() -> None:
    t = torch.arange(25, dtype=torch.float32)  # 100 bytes
    bufs = MsgpackEncoder().encode(request(prompt_embeds=t))
    assert len(bufs) == 1
    got = MsgpackDecoder(EngineCoreRequest).decode(bufs).prompt_embeds
    assert torch.equal(got, t) and got.dtype == t.dtype


def test_large_tensor_is_a_second_buffer_sharing_memory() -> None:
    t = torch.arange(2500, dtype=torch.float32)  # 10,000 bytes
    bufs = MsgpackEncoder().encode(request(prompt_embeds=t))
    assert len(bufs) == 2
    assert len(bufs[0]) < 1000  # only (dtype, shape, index) and the rest of the request
    view = np.frombuffer(bufs[1], dtype=np.float32)
    assert view.ctypes.data == t.data_ptr()  # the same memory: no copy
    got = MsgpackDecoder(EngineCoreRequest).decode(bufs).prompt_embeds
    assert torch.equal(got, t)
    assert got.data_ptr() == t.data_ptr()  # decoded in place over the frame, again no copy


def test_the_seeds_image_tensor_is_frame_one_and_its_header_is_all_frame_zero_holds() -> None:
    """The seed's worked example (issue 23): a [3, 336, 336] float16 tensor (677,376 bytes) in
    a request is buffer 1, the tensor's own memory; the msgpack frame holds only
    ("float16", (3, 336, 336), 1) for it."""
    t = torch.randn(3, 336, 336).half()
    bufs = MsgpackEncoder().encode(request(prompt_embeds=t))
    assert len(bufs) == 2 and len(bufs[1]) == 677_376
    assert np.frombuffer(bufs[1], dtype=np.uint8).ctypes.data == t.data_ptr()  # not copied
    fields = msgspec.msgpack.decode(bytes(bufs[0]))
    ext = next(f for f in fields if isinstance(f, msgspec.msgpack.Ext))
    assert msgspec.msgpack.decode(ext.data) == ["float16", [3, 336, 336], 1]
    got = MsgpackDecoder(EngineCoreRequest).decode(bufs).prompt_embeds
    assert got.dtype == torch.float16 and torch.equal(got, t)


def test_large_ndarray_is_a_second_buffer_sharing_memory() -> None:
    a = np.arange(5000, dtype=np.int16).reshape(50, 100)
    bufs = MsgpackEncoder().encode({"a": a, "small": np.ones(3)})
    assert len(bufs) == 2 and np.shares_memory(np.frombuffer(bufs[1], np.int16), a)
    got = MsgpackDecoder().decode(bufs)
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["small"], np.ones(3))
    assert got["a"].dtype == np.int16 and got["a"].shape == (50, 100)


def test_threshold_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.zeros(2500)  # 10,000 bytes
    monkeypatch.setenv("TREADLE_MSGPACK_ZERO_COPY_THRESHOLD", "20000")
    assert len(MsgpackEncoder().encode(t)) == 1
    monkeypatch.setenv("TREADLE_MSGPACK_ZERO_COPY_THRESHOLD", "64")
    assert len(MsgpackEncoder().encode(torch.zeros(25))) == 2


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(3, 4).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.tensor(3.5),  # 0-d
        torch.empty(0, 7),
        torch.arange(6000, dtype=torch.int64).reshape(60, 100)[:, ::2],  # non-contiguous
        torch.randn(300, requires_grad=True),
        torch.randn(4, 4, dtype=torch.complex64),
    ],
)
def test_tensor_kinds(t: torch.Tensor) -> None:
    got = roundtrip({"t": t})["t"]
    assert got.dtype == t.dtype and got.shape == t.shape
    assert torch.equal(got, t.detach())


def test_decode_over_zmq_frames_is_zero_copy() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://serial-test")
        b.connect("inproc://serial-test")
        t = torch.randn(1000, 100)
        a.send_multipart(MsgpackEncoder().encode(request(prompt_embeds=t)), copy=False)
        frames = b.recv_multipart(copy=False)
        got = MsgpackDecoder(EngineCoreRequest).decode(frames).prompt_embeds
        assert torch.equal(got, t)
        assert got.data_ptr() == np.frombuffer(frames[1].buffer, np.uint8).ctypes.data
        # Read-only frames (bytes) work too; the tensor is then a copy.
        got2 = MsgpackDecoder(EngineCoreRequest).decode([f.bytes for f in frames])
        assert torch.equal(got2.prompt_embeds, t)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_encode_into_reuses_the_buffer() -> None:
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    buf = bytearray(16)
    bufs = enc.encode_into(outputs(), buf)
    assert bufs[0] is buf
    assert dec.decode(bufs) == outputs()
    bufs = enc.encode_into(EngineCoreOutputs(engine_index=2), buf)
    assert bufs[0] is buf and dec.decode(bufs) == EngineCoreOutputs(engine_index=2)


class Opaque:
    def __init__(self, x: int):
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.x == self.x


def test_pickle_is_refused_by_default() -> None:
    with pytest.raises(TypeError, match="TREADLE_ALLOW_INSECURE_SERIALIZATION"):
        MsgpackEncoder().encode({"result": Opaque(1)})
    with pytest.raises(TypeError, match="Opaque"):
        MsgpackEncoder().encode(UtilityOutput(call_id=1, result=Opaque(1)))


def test_pickle_only_with_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_ALLOW_INSECURE_SERIALIZATION", "1")
    bufs = MsgpackEncoder().encode(UtilityOutput(call_id=1, result=Opaque(5)))
    assert MsgpackDecoder(UtilityOutput).decode(bufs).result == Opaque(5)
    # A receiver without the variable refuses it, with a decode error.
    monkeypatch.delenv("TREADLE_ALLOW_INSECURE_SERIALIZATION")
    with pytest.raises(DecodeError, match="refusing a pickled value"):
        MsgpackDecoder(UtilityOutput).decode(bufs)


def test_arrays_in_untyped_fields() -> None:
    bufs = MsgpackEncoder().encode(UtilityOutput(call_id=1, result=[np.arange(3000), "x"]))
    got = MsgpackDecoder(UtilityOutput).decode(bufs)
    np.testing.assert_array_equal(got.result[0], np.arange(3000))


def _header(dtype: str, shape: tuple[int, ...], data: Any) -> bytes:
    return msgspec.msgpack.encode((dtype, shape, data))


@pytest.mark.parametrize(
    "frames,match",
    [
        ([], "no frames"),
        ([b""], "truncated"),
        ([msgspec.msgpack.encode(msgspec.msgpack.Ext(9, b""))], "unknown msgpack extension"),
        ([msgspec.msgpack.encode(msgspec.msgpack.Ext(1, _header("float32", (4,), 1)))], "index"),
        (
            [msgspec.msgpack.encode(msgspec.msgpack.Ext(1, _header("float32", (4,), 1))), b"12"],
            "does not match",
        ),
        ([msgspec.msgpack.encode(msgspec.msgpack.Ext(1, _header("evil", (1,), b"1")))], "dtype"),
        ([msgspec.msgpack.encode(msgspec.msgpack.Ext(2, _header("O", (1,), b"1" * 8)))], "dtype"),
        ([msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"\xff\xff"))], "."),
    ],
)
def test_malformed_messages_give_decode_errors(frames: list[bytes], match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        MsgpackDecoder().decode(frames)


def test_fuzzed_and_truncated_messages_never_crash() -> None:
    rng = random.Random(1234)
    samples = [
        (EngineCoreRequest, MsgpackEncoder().encode(request(prompt_embeds=torch.randn(8, 8)))),
        (EngineCoreRequest, MsgpackEncoder().encode(request(prompt_embeds=torch.randn(100)))),
        (EngineCoreOutputs, MsgpackEncoder().encode(outputs())),
    ]
    tried = 0
    for t, bufs in samples:
        decoder = MsgpackDecoder(t)
        data = bytes(bufs[0])
        variants: list[bytes] = [data[:n] for n in range(len(data))]
        for _ in range(1500):
            mutated = bytearray(data)
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            variants.append(bytes(mutated))
        variants += [rng.randbytes(rng.randrange(1, 200)) for _ in range(500)]
        for variant in variants:
            with contextlib.suppress(DecodeError):
                decoder.decode([variant, *bufs[1:]])
            tried += 1
    assert tried > 5000
