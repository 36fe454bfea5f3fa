"""The seed's worked example on treadle's wire: a request carrying one [3, 336, 336] float16
image (677,376 bytes) leaves the front end as two frames, the msgpack one holding only
`("float16", (3, 336, 336), 1)` for it and the pixels as buffer 1 over the tensor's own memory
(no copy on the sending side); with the tensor ring (`--tensor-ipc shm`) the whole ZMQ message
is under 1 KiB. Both decode back to the same pixels on the engine core's side."""

from __future__ import annotations

import os
import uuid

import msgspec
import numpy as np
import torch

from treadle.ipc.serial import MsgpackDecoder, MsgpackEncoder
from treadle.ipc.tensor_ring import TensorRingReader, TensorRingWriter, ring_name
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import EngineCoreRequest, MultiModalInput


def image_request() -> tuple[EngineCoreRequest, torch.Tensor]:
    pixels = torch.randn(3, 336, 336).to(torch.float16)
    ids = [1, 2, 49152, 3]  # on the wire the image is one placeholder; the engine expands it
    mm = MultiModalInput(pixels, 2, 576, "f" * 64)
    request = EngineCoreRequest("r-1", ids, SamplingParams(max_tokens=4), mm_inputs=[mm])
    return request, pixels


def ext_headers(frame: bytes) -> list[object]:
    """The (dtype, shape, index) headers of the array extensions in a msgpack frame."""
    found: list[object] = []

    def hook(code: int, data: memoryview) -> None:
        found.append(msgspec.msgpack.decode(data))

    msgspec.msgpack.decode(frame, ext_hook=hook)
    return found


def test_the_image_is_buffer_1_over_the_tensors_own_memory() -> None:
    request, pixels = image_request()
    bufs = MsgpackEncoder(allow_pickle=False).encode(request)
    assert len(bufs) == 2
    assert memoryview(bufs[1]).nbytes == 3 * 336 * 336 * 2 == 677_376
    assert np.frombuffer(bufs[1], dtype=np.uint8).ctypes.data == pixels.data_ptr()
    assert ext_headers(bytes(bufs[0])) == [["float16", [3, 336, 336], 1]]
    assert len(bufs[0]) < 1024  # the msgpack frame holds no pixel
    decoded = MsgpackDecoder(EngineCoreRequest, allow_pickle=False).decode(
        [bytes(bufs[0]), bytes(bufs[1])]
    )
    assert decoded.mm_inputs is not None
    assert torch.equal(decoded.mm_inputs[0].pixel_values, pixels)
    assert (decoded.mm_inputs[0].offset, decoded.mm_inputs[0].length) == (2, 576)


def test_through_the_tensor_ring_the_message_is_under_1_kib() -> None:
    request, pixels = image_request()
    address = f"ipc:///tmp/treadle-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    writer = TensorRingWriter(ring_name(address), data_bytes=4 << 20)
    try:
        bufs = MsgpackEncoder(allow_pickle=False, tensor_ring=writer).encode(request)
        assert len(bufs) == 1
        assert len(bufs[0]) < 1024
        reader = TensorRingReader([writer.name])
        try:
            decoded = MsgpackDecoder(
                EngineCoreRequest, allow_pickle=False, tensor_rings=reader
            ).decode(bufs)
        finally:
            reader.close()
        assert decoded.mm_inputs is not None
        assert torch.equal(decoded.mm_inputs[0].pixel_values, pixels)
    finally:
        writer.close()
