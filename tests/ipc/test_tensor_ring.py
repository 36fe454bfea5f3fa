"""The tensor ring (`--tensor-ipc shm`): write, read, wrap, release, fallback, bad handles, and
the request encoding that carries a handle instead of the tensor."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch

from treadle.ipc.serial import DecodeError, MsgpackDecoder, MsgpackEncoder
from treadle.ipc.tensor_ring import (
    TensorRingError,
    TensorRingReader,
    TensorRingWriter,
    remove_orphaned_rings,
    ring_name,
)
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import EngineCoreRequest


def _exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


@pytest.fixture
def address() -> str:
    return f"ipc:///tmp/test-{uuid.uuid4()}"


@pytest.fixture
def writer(address: str) -> Iterator[TensorRingWriter]:
    w = TensorRingWriter(ring_name(address), data_bytes=4096, slots=4)
    yield w
    w.close()


def _bytes(n: int, fill: int) -> memoryview:
    return memoryview(bytes([fill]) * n)


def test_write_read_release(writer: TensorRingWriter) -> None:
    reader = TensorRingReader([writer.name])
    handle = writer.put(_bytes(1000, 7))
    assert handle is not None and handle[2] == 0
    assert bytes(reader.take(writer.name, *handle)) == bytes([7]) * 1000
    for i in range(4):  # the released region and its slot are used again
        assert writer.put(_bytes(1000, i)) is not None
    with pytest.raises(TensorRingError, match="is not there"):
        reader.take(writer.name, *handle)
    reader.close()


def test_wraps_and_reuses_released_regions(writer: TensorRingWriter) -> None:
    reader = TensorRingReader([writer.name])
    offsets = []
    prev = None
    for i in range(12):  # 3 x the ring's 4096 bytes, one region always in flight
        handle = writer.put(_bytes(1000, i))
        assert handle is not None
        offsets.append(handle[2])
        if prev is not None:
            assert bytes(reader.take(writer.name, *prev)) == bytes([i - 1]) * 1000
        prev = handle
    assert offsets[:6] == [0, 1024, 2048, 3072, 0, 1024]
    assert writer.in_flight <= 2
    reader.close()


def test_full_ring_falls_back_then_frees_on_release(writer: TensorRingWriter) -> None:
    reader = TensorRingReader([writer.name])
    a = writer.put(_bytes(2000, 1))
    b = writer.put(_bytes(2000, 2))
    assert a is not None and b is not None
    assert writer.put(_bytes(2000, 3)) is None  # no room: the caller sends it directly
    assert writer.put(_bytes(5000, 3)) is None  # larger than the ring
    reader.take(writer.name, *a)
    c = writer.put(_bytes(2000, 3))  # wraps into a's released region
    assert c is not None and c[2] == 0
    assert bytes(reader.take(writer.name, *b)) == bytes([2]) * 2000
    assert bytes(reader.take(writer.name, *c)) == bytes([3]) * 2000
    reader.close()


def test_slots_bound_the_regions_in_flight(writer: TensorRingWriter) -> None:
    handles = [writer.put(_bytes(10, i)) for i in range(4)]
    assert all(h is not None for h in handles)
    assert writer.put(_bytes(10, 9)) is None


def test_stale_regions_are_reclaimed_and_their_handles_fail(address: str) -> None:
    w = TensorRingWriter(ring_name(address), data_bytes=4096, slots=4, stale_s=0.0)
    try:
        reader = TensorRingReader([w.name])
        lost = w.put(_bytes(3000, 1))  # its message was lost: never read
        assert lost is not None
        fresh = w.put(_bytes(3000, 2))  # reclaims the stale region
        assert fresh is not None and fresh[2] == 0
        with pytest.raises(TensorRingError):
            reader.take(w.name, *lost)
        assert bytes(reader.take(w.name, *fresh)) == bytes([2]) * 3000
        reader.close()
    finally:
        w.close()


def test_bad_handles_are_refused(writer: TensorRingWriter) -> None:
    reader = TensorRingReader([writer.name])
    nonce, seq, offset, length = writer.put(_bytes(100, 1)) or (0, 0, 0, 0)
    bad = [
        (nonce, seq, 4000, 200),  # past the end
        (nonce, seq, -1, 100),
        (nonce, seq, 0, 0),
        (nonce, seq, 0, 1 << 40),
        (nonce, seq + 1, 0, 100),  # never written
        (nonce, 0, 0, 100),
        (nonce ^ 1, seq, 0, 100),  # another ring by the same name
    ]
    for handle in bad:
        with pytest.raises(TensorRingError):
            reader.take(writer.name, *handle)
    with pytest.raises(TensorRingError, match="not one of"):
        reader.take("treadle_tr_other", nonce, seq, offset, length)
    with pytest.raises(TensorRingError, match="not one of"):
        TensorRingReader([]).take(writer.name, nonce, seq, offset, length)
    assert bytes(reader.take(writer.name, nonce, seq, offset, length)) == bytes([1]) * 100
    reader.close()


def test_a_vanished_ring_is_an_error(address: str) -> None:
    w = TensorRingWriter(ring_name(address), data_bytes=4096)
    handle = w.put(_bytes(100, 1))
    assert handle is not None
    w.close()
    assert not _exists(w.name)
    with pytest.raises(TensorRingError, match="gone"):
        TensorRingReader([w.name]).take(w.name, *handle)


def test_a_ring_left_by_a_dead_creator_is_replaced_and_removed(address: str) -> None:
    pid = os.fork()
    if pid == 0:  # a front end that dies without closing its ring
        _w = TensorRingWriter(ring_name(address), data_bytes=4096)
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    name = ring_name(address)
    assert _exists(name)
    w = TensorRingWriter(name, data_bytes=4096)  # a replacement on the same address
    w.close()
    assert not _exists(name)
    pid = os.fork()
    if pid == 0:
        _w = TensorRingWriter(ring_name(address), data_bytes=4096)
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    assert _exists(name)
    remove_orphaned_rings([address])  # an engine core whose front end died
    assert not _exists(name)


def test_a_live_creators_ring_is_kept(writer: TensorRingWriter, address: str) -> None:
    remove_orphaned_rings([address])
    assert _exists(writer.name)
    with pytest.raises(RuntimeError, match="alive"):
        pid = os.fork()
        if pid == 0:
            try:
                TensorRingWriter(writer.name, data_bytes=4096)
            except RuntimeError:
                os._exit(0)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        raise RuntimeError("alive")


# -- the request encoding ------------------------------------------------------------------------


def _request(embeds: torch.Tensor) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=list(range(32)),
        sampling_params=SamplingParams(),
        arrival_time=0.0,
        prompt_embeds=embeds,
    )


def test_the_seeds_tensor_travels_as_a_handle_under_1_kib(address: str) -> None:
    image = torch.randn(3, 336, 336).to(torch.float16)  # 677,376 bytes
    w = TensorRingWriter(ring_name(address), data_bytes=4 << 20)
    try:
        frames = MsgpackEncoder(tensor_ring=w).encode(_request(image))
        assert len(frames) == 1  # no frame for the tensor
        assert len(frames[0]) < 1024
        direct = MsgpackEncoder().encode(_request(image))
        assert len(direct) == 2 and memoryview(direct[1]).nbytes == image.nbytes
        decoder = MsgpackDecoder(EngineCoreRequest, tensor_rings=TensorRingReader([w.name]))
        got = decoder.decode([bytes(frames[0])])
        assert got.prompt_embeds.dtype == torch.float16
        assert torch.equal(got.prompt_embeds, image)
        assert got.prompt_token_ids == list(range(32))
    finally:
        w.close()


def test_small_tensors_and_a_full_ring_go_directly(address: str) -> None:
    w = TensorRingWriter(ring_name(address), data_bytes=1 << 20)
    try:
        enc = MsgpackEncoder(tensor_ring=w)
        decoder = MsgpackDecoder(EngineCoreRequest, tensor_rings=TensorRingReader([w.name]))
        small = torch.ones(4, 16)  # under the 64 KiB threshold
        assert len(enc.encode(_request(small))) == 2
        big = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: more than the ring
        frames = enc.encode(_request(big))
        assert len(frames) == 2
        assert torch.equal(decoder.decode(frames).prompt_embeds, big)
    finally:
        w.close()


def test_ring_handles_are_refused_without_a_reader_or_when_hostile(address: str) -> None:
    image = torch.randn(3, 336, 336).to(torch.float16)
    w = TensorRingWriter(ring_name(address), data_bytes=4 << 20)
    try:
        frames = MsgpackEncoder(tensor_ring=w).encode(_request(image))
        with pytest.raises(DecodeError, match="none is accepted"):
            MsgpackDecoder(EngineCoreRequest).decode(frames)
        with pytest.raises(DecodeError, match="not one of"):
            MsgpackDecoder(EngineCoreRequest, tensor_rings=TensorRingReader([])).decode(frames)
        # A handle whose length does not match the shape, and one out of the ring.
        enc = msgspec.msgpack.Encoder()
        nonce = w.nonce
        for header in [
            ("float16", [3, 336, 336], w.name, nonce, 1, 0, 100),
            ("float16", [3, 336, 336], w.name, nonce, 1, 4 << 20, 677_376),
            ("float16", [3, 336, 336], "../../etc/passwd", nonce, 1, 0, 677_376),
            ("float16", [3, 336, 336], w.name, nonce, 1, 0),
        ]:
            raw = enc.encode(msgspec.msgpack.Ext(4, enc.encode(header)))
            reader = TensorRingReader([w.name])
            with pytest.raises(DecodeError):
                MsgpackDecoder(tensor_rings=reader).decode(raw)
    finally:
        w.close()


def test_ndarrays_do_not_use_the_ring(address: str) -> None:
    w = TensorRingWriter(ring_name(address), data_bytes=4 << 20)
    try:
        arr = np.zeros(100_000, np.float32)
        assert len(MsgpackEncoder(tensor_ring=w).encode(arr)) == 2
    finally:
        w.close()
