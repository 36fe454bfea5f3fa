"""The ZMQ wire format: msgpack (msgspec) with torch tensors and numpy arrays out of band.

`MsgpackEncoder.encode(obj)` returns a list of buffers, ready for `send_multipart(copy=False)`:

    [ msgpack bytes | array 1 | array 2 | ... ]
      buffer 0        buffer 1  buffer 2

An array (torch tensor or numpy ndarray) travels as a msgpack extension whose payload is the
msgpack triple `(dtype, shape, data)`:

- smaller than the threshold (`TREADLE_MSGPACK_ZERO_COPY_THRESHOLD`, 256 bytes): `data` is the
  raw bytes, inline in buffer 0;
- otherwise: `data` is the index of an extra buffer, which is a view of the array's own memory
  (no copy). The array must not change until the frames have been sent.

With a `TensorRingWriter` (`--tensor-ipc shm`, `tensor_ring.py`), a torch tensor of at least
`TREADLE_TENSOR_IPC_SHM_THRESHOLD` bytes (64 KiB) is copied into the shared-memory ring instead
and travels as extension 4, `(dtype, shape, ring name, nonce, seq, offset, length)`, a few dozen
bytes; when the ring has no room it goes as an extra buffer. Only a decoder given a
`TensorRingReader` accepts extension 4; it copies the bytes out (releasing the region) and a
handle it cannot read raises `DecodeError`.

Extensions decode wherever they appear, also inside `Any`-typed fields (e.g.
`UtilityOutput.result`). The decoder rebuilds out-of-band arrays as views of the received frames
(zero-copy; a torch tensor over a read-only frame such as `bytes` is copied, because torch has
no read-only tensors).

Anything else msgspec cannot encode raises `TypeError`, unless
`TREADLE_ALLOW_INSECURE_SERIALIZATION=1`, which lets pickle carry it; the decoder likewise refuses
a pickled value unless the variable is set on its side. A malformed or truncated message raises
`msgspec.DecodeError` (a `ValidationError` when well-formed but of the wrong shape); decoding never
crashes the caller's loop in any other way.

An encoder or decoder instance is used by one thread at a time (it keeps per-call state).

Neither torch nor numpy is imported until an array is met (issue 41 item 2: the API server,
which sends text and token ids, never loads torch): the encoder recognises arrays only of
modules already loaded (an object of an unloaded module cannot exist), and the decoder imports
torch (numpy) when the first tensor (array) arrives. A wire type's tensor field is annotated
`Tensor` below, which msgspec resolves without torch.
"""

from __future__ import annotations

import functools
import math
import pickle
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import msgspec

from treadle import envs
from treadle.ipc.tensor_ring import TensorRingError, TensorRingReader, TensorRingWriter

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import Tensor

    Array = Tensor | np.ndarray
else:

    class _TensorType(type):
        def __instancecheck__(cls, obj: object) -> bool:
            torch = sys.modules.get("torch")
            return torch is not None and isinstance(obj, torch.Tensor)

    class Tensor(metaclass=_TensorType):
        """`torch.Tensor` to msgspec and to `isinstance`, without importing torch: the type of
        a wire type's tensor field (a decoded tensor field holds a real `torch.Tensor`)."""

    class _ArrayType(type):
        def __instancecheck__(cls, obj: object) -> bool:
            torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
            return (torch is not None and isinstance(obj, torch.Tensor)) or (
                np is not None and isinstance(obj, np.ndarray)
            )

    class Array(metaclass=_ArrayType):
        """A `torch.Tensor` or a numpy array, to msgspec and to `isinstance`: the type of a
        wire field that either runner fills (the lean runner's are numpy arrays)."""


__all__ = [
    "Array",
    "Buffer",
    "DecodeError",
    "MsgpackDecoder",
    "MsgpackEncoder",
    "Tensor",
    "tensor_from_buffer",
    "tensor_to_buffer",
]

Buffer: TypeAlias = bytes | bytearray | memoryview
"""One frame of an encoded message."""

DecodeError = msgspec.DecodeError
"""Raised for every malformed, truncated or refused message."""

_EXT_TENSOR = 1
_EXT_NDARRAY = 2
_EXT_PICKLE = 3
_EXT_TENSOR_RING = 4


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """Wire name -> torch dtype (imports torch: called only when a tensor is met)."""
    import torch

    return {
        str(dtype).removeprefix("torch."): dtype
        for dtype in (
            torch.float64,
            torch.float32,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.complex128,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        )
    }


@functools.cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in _torch_dtypes().items()}


def _loaded(module: str) -> Any:
    """`module` if this process has imported it, else None."""
    return sys.modules.get(module)


_ArrayHeader: TypeAlias = tuple[str, tuple[int, ...], int | bytearray]
_RingHeader: TypeAlias = tuple[str, tuple[int, ...], str, int, int, int, int]
_header_encoder = msgspec.msgpack.Encoder()


class MsgpackEncoder:
    """Encodes msgspec Structs and plain data into `[msgpack, *array buffers]`."""

    def __init__(
        self,
        size_threshold: int | None = None,
        allow_pickle: bool | None = None,
        tensor_ring: TensorRingWriter | None = None,
        ring_threshold: int | None = None,
    ):
        self.size_threshold = (
            envs.msgpack_zero_copy_threshold() if size_threshold is None else size_threshold
        )
        self.tensor_ring = tensor_ring
        self.ring_threshold = (
            envs.tensor_ipc_shm_threshold() if ring_threshold is None else ring_threshold
        )
        self.allow_pickle = (
            envs.allow_insecure_serialization() if allow_pickle is None else allow_pickle
        )
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._bufs: list[Buffer] | None = None

    def encode(self, obj: Any) -> list[Buffer]:
        """Encode `obj`; buffer 0 is the msgpack bytes, then one buffer per large array."""
        bufs: list[Buffer] = [b""]
        self._bufs = bufs
        try:
            bufs[0] = self._encoder.encode(obj)
        finally:
            self._bufs = None
        return bufs

    def encode_into(self, obj: Any, buf: bytearray) -> list[Buffer]:
        """Like `encode`, writing the msgpack bytes into `buf` (resized to fit) to reuse it.

        `buf` must not be in flight (e.g. still held by a zero-copy ZMQ send) when reused.
        """
        bufs: list[Buffer] = [buf]
        self._bufs = bufs
        try:
            self._encoder.encode_into(obj, buf)
        finally:
            self._bufs = None
        return bufs

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            return self._encode_tensor(obj)
        np = _loaded("numpy")
        if (
            np is not None
            and isinstance(obj, np.ndarray)
            and not obj.dtype.hasobject
            and obj.dtype.fields is None
        ):
            arr = np.ascontiguousarray(obj)
            return self._encode_array(_EXT_NDARRAY, arr.dtype.str, arr.shape, _raw_bytes(arr))
        if self.allow_pickle:
            return msgspec.msgpack.Ext(_EXT_PICKLE, pickle.dumps(obj, protocol=5))
        raise TypeError(
            f"cannot serialize an object of type {type(obj).__qualname__}: only msgspec types, "
            "torch tensors and numpy arrays travel between processes. Set "
            "TREADLE_ALLOW_INSECURE_SERIALIZATION=1 to send it with pickle (trusted hosts only)."
        )

    def _encode_tensor(self, tensor: torch.Tensor) -> msgspec.msgpack.Ext:
        dtype, shape, raw = tensor_to_buffer(tensor)
        ring = self.tensor_ring
        if ring is not None and raw.nbytes >= self.ring_threshold:
            handle = ring.put(raw)
            if handle is not None:
                header = (dtype, shape, ring.name, *handle)
                return msgspec.msgpack.Ext(_EXT_TENSOR_RING, _header_encoder.encode(header))
        return self._encode_array(_EXT_TENSOR, dtype, shape, raw)

    def _encode_array(
        self, code: int, dtype: str, shape: tuple[int, ...], raw: memoryview
    ) -> msgspec.msgpack.Ext:
        bufs = self._bufs
        assert bufs is not None
        data: int | memoryview
        if raw.nbytes < self.size_threshold:
            data = raw
        else:
            data = len(bufs)
            bufs.append(raw)
        return msgspec.msgpack.Ext(code, _header_encoder.encode((dtype, shape, data)))


class MsgpackDecoder:
    """Decodes what `MsgpackEncoder` made into `t` (default: plain Python data)."""

    def __init__(
        self,
        t: Any = Any,
        allow_pickle: bool | None = None,
        tensor_rings: TensorRingReader | None = None,
    ):
        self.allow_pickle = (
            envs.allow_insecure_serialization() if allow_pickle is None else allow_pickle
        )
        self.tensor_rings = tensor_rings
        self._decoder = msgspec.msgpack.Decoder(t, dec_hook=_dec_hook, ext_hook=self._ext_hook)
        self._header_decoder = msgspec.msgpack.Decoder(_ArrayHeader)
        self._ring_decoder = msgspec.msgpack.Decoder(_RingHeader)
        self._bufs: Sequence[Any] = ()

    def decode(self, bufs: Buffer | Sequence[Any]) -> Any:
        """Decode one message: a single buffer, or the frames `[msgpack, *arrays]`.

        Frames may be `bytes`, `bytearray`, `memoryview` or `zmq.Frame`; arrays are views of them.
        """
        frames: Sequence[Any] = bufs if isinstance(bufs, list | tuple) else (bufs,)
        if not frames:
            raise DecodeError("empty message: no frames")
        self._bufs = frames
        try:
            return self._decoder.decode(frames[0])
        except msgspec.DecodeError:
            raise
        except Exception as e:
            raise DecodeError(f"malformed message: {type(e).__name__}: {e}") from e
        finally:
            self._bufs = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_PICKLE:
            if not self.allow_pickle:
                raise DecodeError(
                    "refusing a pickled value: set TREADLE_ALLOW_INSECURE_SERIALIZATION=1 on both "
                    "sides to accept pickle (trusted hosts only)"
                )
            return pickle.loads(data)
        if code == _EXT_TENSOR_RING:
            return self._from_ring(data)
        if code not in (_EXT_TENSOR, _EXT_NDARRAY):
            raise DecodeError(f"unknown msgpack extension type {code}")
        dtype_name, shape, payload = self._header_decoder.decode(data)
        if isinstance(payload, int):
            if not 0 < payload < len(self._bufs):
                raise DecodeError(
                    f"array buffer index {payload} out of range: message has "
                    f"{len(self._bufs)} frames"
                )
            mem = memoryview(self._bufs[payload]).cast("B")
        else:
            mem = memoryview(payload)
        if code == _EXT_TENSOR:
            return tensor_from_buffer(mem, dtype_name, shape)
        return _ndarray_from(mem, dtype_name, shape)

    def _from_ring(self, data: memoryview) -> torch.Tensor:
        if self.tensor_rings is None:
            raise DecodeError("a tensor ring handle where none is accepted")
        dtype_name, shape, name, nonce, seq, offset, length = self._ring_decoder.decode(data)
        try:
            raw = self.tensor_rings.take(name, nonce, seq, offset, length)
        except TensorRingError as e:
            raise DecodeError(str(e)) from e
        return tensor_from_buffer(memoryview(raw), dtype_name, shape)


def _dec_hook(t: type, obj: Any) -> Any:
    if _is_array_type(t) and isinstance(obj, t):
        return obj
    raise TypeError(f"expected {t.__qualname__}, got {type(obj).__qualname__}")


def _is_array_type(t: type) -> bool:
    """Whether a field of type `t` may hold a decoded array: `Tensor`, `Array`, `torch.Tensor` /
    `np.ndarray` (a type annotated with one of these has imported its module)."""
    if t is Tensor or t is Array:
        return True
    torch, np = _loaded("torch"), _loaded("numpy")
    return (torch is not None and t is torch.Tensor) or (np is not None and t is np.ndarray)


def _raw_bytes(arr: np.ndarray) -> memoryview:
    """A flat, writable-or-not byte view of a C-contiguous array's memory (no copy)."""
    import numpy as np

    return arr.reshape(-1).view(np.uint8).data


def _check_size(mem: memoryview, shape: tuple[int, ...], itemsize: int) -> None:
    if any(d < 0 for d in shape) or math.prod(shape) * itemsize != mem.nbytes:
        raise DecodeError(
            f"array of shape {shape} and item size {itemsize} does not match its "
            f"{mem.nbytes}-byte buffer"
        )


def tensor_to_buffer(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], memoryview]:
    """`(dtype name, shape, raw bytes)` of a tensor; the bytes are a view of its memory when it is
    a contiguous CPU tensor (otherwise of a contiguous CPU copy). `TypeError` for an unknown dtype.
    """
    import numpy as np
    import torch

    name = _dtype_names().get(tensor.dtype)
    if name is None:
        raise TypeError(f"cannot serialize a tensor of dtype {tensor.dtype}")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    return name, tuple(tensor.shape), _raw_bytes(raw)


def tensor_from_buffer(mem: memoryview, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `tensor_to_buffer`: a tensor over `mem` (copied only if `mem` is read-only).

    Raises `DecodeError` for an unknown dtype or a size that does not match the shape.
    """
    import torch

    dtype = _torch_dtypes().get(dtype_name)
    if dtype is None:
        raise DecodeError(f"unknown tensor dtype {dtype_name!r}")
    _check_size(mem, shape, dtype.itemsize)
    if mem.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if mem.readonly:
        mem = memoryview(bytearray(mem))
    return torch.frombuffer(mem, dtype=torch.uint8).view(dtype).view(shape)


def _ndarray_from(mem: memoryview, dtype_name: str, shape: tuple[int, ...]) -> np.ndarray:
    import numpy as np

    try:
        dtype = np.dtype(dtype_name)
    except TypeError as e:
        raise DecodeError(f"unknown array dtype {dtype_name!r}") from e
    if dtype.hasobject or dtype.fields is not None:
        raise DecodeError(f"refusing array dtype {dtype_name!r}")
    _check_size(mem, shape, dtype.itemsize)
    return np.frombuffer(mem, dtype=dtype).reshape(shape)
