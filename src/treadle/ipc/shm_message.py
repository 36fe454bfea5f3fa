"""How one `MessageQueue` message is serialized (its codec), and laid out in a ring chunk.

A message is buffer 0 (the serialized object) plus its out-of-band buffers (large arrays), so
an array is copied once into shared memory and once out, never into buffer 0 as well. In a
chunk:

    | overflow: u8 | n buffers: u32 | n x length: u64 | buffer 0 | buffer 1 | ... |

A message that does not fit writes overflow=1 alone and travels as ZMQ frames, in the same
`[buffer 0, *buffers]` order.

Two codecs:

- `PickleCodec` ("pickle"): a protocol-5 pickle; every pickle buffer of `OOB_THRESHOLD` (1 MiB)
  or more (numpy arrays, and CPU tensors, which are reduced to their raw bytes) is out of band.
  Any picklable object; for queues whose readers are all on this host (a pickle executes what
  it names: a reader on another host never unpickles, ARCHITECTURE §8).
- `MsgpackCodec` ("msgpack", or a subclass's name): msgspec msgpack with arrays out of band
  (`treadle.ipc.serial`); plain data, msgspec Structs, tensors and arrays only, decoded into a
  given type. What a queue read on another host carries (`cross_host = True`).
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from treadle.ipc.serial import (
    Buffer,
    MsgpackDecoder,
    MsgpackEncoder,
    Tensor,
    tensor_from_buffer,
    tensor_to_buffer,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "OOB_THRESHOLD",
    "Codec",
    "MsgpackCodec",
    "PickleCodec",
    "is_overflow",
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
        if isinstance(obj, Tensor):  # (never one where torch is not imported)
            dtype, shape, raw = tensor_to_buffer(obj)
            return _rebuild_tensor, (pickle.PickleBuffer(raw), dtype, shape)
        return NotImplemented


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return tensor_from_buffer(memoryview(buf).cast("B"), dtype, shape)


class Codec(Protocol):
    """Turns a message into `[buffer 0, *out-of-band buffers]` and back (one thread each)."""

    name: ClassVar[str]
    """Recorded in the queue's handle: a reader's codec must be the writer's."""
    cross_host: ClassVar[bool]
    """Safe for a reader on another host (decoding executes nothing the message names)."""

    def dumps(self, obj: Any) -> list[Buffer]:
        """The message's buffers; valid until `release` (buffer 0 may be reused by the next)."""
        ...

    def release(self, bufs: list[Buffer]) -> None:
        """The buffers of `dumps` were written or sent: what they hold may be reused."""
        ...

    def loads(self, bufs: Sequence[Any]) -> Any:
        """The message from its buffers (`bytes`, `bytearray`, `memoryview` or `zmq.Frame`);
        buffer 0 may be a view of shared memory, valid only during the call."""
        ...


class PickleCodec:
    """Pickles messages into `[stream, *out-of-band buffers]`, reusing its pickler (one thread)."""

    name: ClassVar[str] = "pickle"
    cross_host: ClassVar[bool] = False

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

    def dumps(self, obj: Any) -> list[Buffer]:
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

    def release(self, bufs: list[Buffer]) -> None:
        view = bufs[0]
        assert isinstance(view, memoryview)
        view.release()  # the stream may grow again

    def loads(self, bufs: Sequence[Any]) -> Any:
        views = [_view(b) for b in bufs]
        return pickle.loads(views[0], buffers=views[1:])


def _view(buf: Any) -> memoryview:
    """A view of a buffer or of a `zmq.Frame` (zero-copy)."""
    return buf.buffer if hasattr(buf, "buffer") else memoryview(buf)


class MsgpackCodec:
    """msgspec msgpack, arrays out of band (`treadle.ipc.serial`), decoded into `decode_type`.

    Buffer 0 is copied out of shared memory before it is parsed: another process could change
    it mid-parse, and `msgspec.Raw` values keep a reference to what they were parsed from.
    """

    name: ClassVar[str] = "msgpack"
    cross_host: ClassVar[bool] = True

    def __init__(self, decode_type: Any = Any) -> None:
        # Arrays under 1 MiB travel inside buffer 0 (copied twice, as pickle's in-band ones).
        self.encoder = MsgpackEncoder(size_threshold=OOB_THRESHOLD, allow_pickle=False)
        self.decoder = MsgpackDecoder(decode_type, allow_pickle=False)

    def dumps(self, obj: Any) -> list[Buffer]:
        return self.encoder.encode(obj)

    def release(self, bufs: list[Buffer]) -> None:
        pass

    def loads(self, bufs: Sequence[Any]) -> Any:
        return self.decoder.decode(own_first(bufs))


def own_first(bufs: Sequence[Any]) -> list[Any]:
    """`bufs` with buffer 0 as `bytes` of its own when it is a view (of shared memory)."""
    first = bufs[0]
    return [bytes(first) if isinstance(first, memoryview) else first, *bufs[1:]]


def write_chunk(chunk: memoryview, bufs: list[Buffer]) -> bool:
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


def read_chunk(chunk: memoryview, codec: Codec) -> Any:
    """Decode an in-chunk message, copying its out-of-band buffers out of shared memory."""
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
        return codec.loads([stream, *oob])
    finally:
        stream.release()
