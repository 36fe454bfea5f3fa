"""How one `MessageQueue` message is serialized, and laid out in a ring chunk.

A message is a protocol-5 pickle plus its out-of-band buffers: every pickle buffer of
`OOB_THRESHOLD` (1 MiB) or more (numpy arrays, and CPU tensors, which are reduced to their raw
bytes) stays outside the pickle stream, so it is copied once into shared memory and once out,
never into the stream as well. In a chunk:

    | overflow: u8 | n buffers: u32 | n x length: u64 | buffer 0 (pickle) | buffer 1 | ... |

A message that does not fit writes overflow=1 alone and travels as ZMQ frames, in the same
`[pickle, *buffers]` order.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

import torch

from treadle.ipc.serial import tensor_from_buffer, tensor_to_buffer

__all__ = [
    "OOB_THRESHOLD",
    "Serializer",
    "is_overflow",
    "loads_frames",
    "read_chunk",
    "write_chunk",
]

OOB_THRESHOLD = 1 << 20
"""Pickle buffers of at least this many bytes travel out of band (no copy into the stream)."""

_PREFIX = struct.Struct("<BI")  # overflow flag, buffer count
_headers: dict[int, struct.Struct] = {}


def _header(n: int) -> struct.Struct:
    """The chunk header for `n` buffers: `<BI` + n x `Q`."""
    fmt = _headers.get(n)
    if fmt is None:
        fmt = _headers[n] = struct.Struct(f"<BI{n}Q")
    return fmt


class _Pickler(pickle.Pickler):
    """Protocol-5 pickler that reduces CPU tensors to raw byte buffers (so they go out of band)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            dtype, shape, raw = tensor_to_buffer(obj)
            return _rebuild_tensor, (pickle.PickleBuffer(raw), dtype, shape)
        return NotImplemented


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return tensor_from_buffer(memoryview(buf).cast("B"), dtype, shape)


class Serializer:
    """Pickles messages into `[stream, *out-of-band buffers]`, reusing its pickler (one thread)."""

    def __init__(self) -> None:
        self._stream = io.BytesIO()
        self._oob: list[memoryview] = []
        self._pickler = _Pickler(self._stream, protocol=5, buffer_callback=self._buffer_callback)

    def _buffer_callback(self, buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < OOB_THRESHOLD:
            return True  # in band
        self._oob.append(raw)
        return False

    def dumps(self, obj: Any) -> list[memoryview]:
        """Buffer 0 is a view of the reused stream: `release()` it before the next call."""
        stream = self._stream
        stream.seek(0)
        stream.truncate()
        oob = self._oob
        try:
            self._pickler.dump(obj)
        finally:
            self._pickler.clear_memo()
            self._oob = []
        return [stream.getbuffer(), *oob]


def write_chunk(chunk: memoryview, bufs: list[memoryview]) -> bool:
    """Write the message `bufs` into `chunk` if it fits (True); else only overflow=1 (False)."""
    sizes = [len(b) for b in bufs]
    header = _header(len(bufs))
    if header.size + sum(sizes) > len(chunk):
        chunk[0] = 1
        return False
    header.pack_into(chunk, 0, 0, len(bufs), *sizes)
    pos = header.size
    for i in range(len(bufs)):
        end = pos + sizes[i]
        chunk[pos:end] = bufs[i]
        pos = end
    return True


def is_overflow(chunk: memoryview) -> bool:
    return chunk[0] == 1


def read_chunk(chunk: memoryview) -> Any:
    """Unpickle an in-chunk message, copying its out-of-band buffers out of shared memory."""
    _, n = _PREFIX.unpack_from(chunk, 0)
    header = _header(n)
    sizes = header.unpack_from(chunk, 0)[2:]
    pos = header.size
    stream = chunk[pos : pos + sizes[0]]
    pos += sizes[0]
    oob = []
    for size in sizes[1:]:
        oob.append(bytearray(chunk[pos : pos + size]))
        pos += size
    try:
        return pickle.loads(stream, buffers=oob)
    finally:
        stream.release()


def loads_frames(frames: list[Any]) -> Any:
    """Unpickle a message received as ZMQ frames (zero-copy over the frames)."""
    return pickle.loads(frames[0].buffer, buffers=[f.buffer for f in frames[1:]])
