"""A GGUF file's metadata and tensors, read in a fraction of a second.

`gguf.GGUFReader` builds a numpy memmap view for every part of every metadata field: for a
model with a 49152-token vocabulary and 48900 merges that is ~1.2 million small arrays and
2-5 s per open, and a serving start opens the file several times (the CLI's checks, the API
server, the engine). Here the header is parsed with `struct` straight from the mapped bytes
(strings decoded once, numeric arrays as one `np.frombuffer` each), and tensor data stays a
view of the memory map until a loader asks for it. Dequantizing the block types the kernels
read (Q4_0, Q4_1, Q8_0) and the float types is vectorized numpy with gguf's own arithmetic
(so the floats are the same bits); the other types go to `gguf.quants.dequantize`.

Layout (little-endian): "GGUF", u32 version (2 or 3), u64 tensor count, u64 field count; each
field: string key, u32 value type, value (a string is u64 length + UTF-8; an array is u32
element type, u64 count, elements); each tensor: string name, u32 dims, u64 dims (innermost
first), u32 GGML type, u64 offset into the data section, which starts at the next multiple of
`general.alignment` (default 32) after the header.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9
# GGML type id -> (name, values a block, bytes a block) for the types treadle reads itself; any
# other comes from the gguf package's tables (imported then: with numpy's and yaml's modules it
# is ~3 MiB of every engine core's memory).
_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34), 30: ("BF16", 1, 2),
}  # fmt: skip
_BLOCK_BYTES = {name: nbytes for name, _, nbytes in _TYPES.values()}


def _type(kind: int) -> tuple[str, int, int]:
    """A GGML type id's name, values a block and bytes a block; ValueError for an unknown id."""
    known = _TYPES.get(kind)
    if known is not None:
        return known
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    t = GGMLQuantizationType(kind)
    return (t.name, *GGML_QUANT_SIZES[t])


class GGUFFormatError(ValueError):
    """The file is not GGUF, or is truncated or corrupt."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # outermost first (numpy order): [rows, cols] for a matrix
    kind: str  # GGML type name: F32, Q4_1, ...
    data: np.ndarray  # uint8 view of the file: the raw blocks, [rows, bytes per row] for 2-D

    def dequantize(self) -> np.ndarray:
        """float32, `shape`, a fresh writable array."""
        raw = self.data.reshape(-1)
        if self.kind == "F32":
            out = raw.view(np.float32).copy()
        elif self.kind == "F16":
            out = raw.view(np.float16).astype(np.float32)
        elif self.kind == "BF16":
            out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif self.kind in ("Q4_0", "Q4_1", "Q8_0"):
            out = dequantize_blocks(self.kind, raw)
        else:
            from gguf.constants import GGMLQuantizationType
            from gguf.quants import dequantize

            out = np.asarray(dequantize(self.data, GGMLQuantizationType[self.kind]), np.float32)
        return out.reshape(self.shape)


def dequantize_blocks(kind: str, raw: np.ndarray) -> np.ndarray:
    """gguf.quants' formulas for Q4_0 (d (q - 8)), Q4_1 (d q + m) and Q8_0 (d q), vectorized."""
    nbytes = _BLOCK_BYTES[kind]
    blocks = raw.reshape(-1, nbytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        return (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    qs = blocks[:, 4:] if kind == "Q4_1" else blocks[:, 2:]
    q = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=1)  # weights i, i + 16
    if kind == "Q4_0":
        return (d * (q.astype(np.int8) - np.int8(8)).astype(np.float32)).reshape(-1)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return ((d * q.astype(np.float32)) + m).reshape(-1)


class GGUFFile:
    """`fields`: every metadata value as plain Python (lists for arrays); `tensors` in file
    order. The memory map stays open as long as a tensor's `data` is referenced."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file
                raise GGUFFormatError(f"{path} is empty") from e
        try:
            self.fields, self.tensors = self._parse(memoryview(self._map))
        except (struct.error, IndexError, UnicodeDecodeError, ValueError, KeyError) as e:
            raise GGUFFormatError(f"{path} is not a readable GGUF file: {e}") from e

    def release_pages(self) -> None:
        """Unmap the pages of the file this process has read so far (its resident set shrinks;
        the OS's page cache keeps them, and a later read maps them again): the loader calls
        it as layers copy their blocks out, so that the file and its copy are never both
        resident."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def _parse(self, buf: memoryview) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (treadle reads 2 and 3)")
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            if pos + 8 + n > len(buf):
                raise ValueError("a string runs past the end of the file")
            text = str(buf[pos + 8 : pos + 8 + n], "utf-8")
            pos += 8 + n
            return text

        def value(kind: int) -> Any:
            nonlocal pos
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                item, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if item in _NUMPY:
                    dtype = np.dtype(_NUMPY[item])
                    end = pos + count * dtype.itemsize
                    if end > len(buf):
                        raise ValueError("an array runs past the end of the file")
                    array = np.frombuffer(buf[pos:end], dtype=dtype)
                    pos = end
                    return array.tolist()
                return [value(item) for _ in range(count)]
            fmt = _SCALARS[kind]
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return v

        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = string()
            (kind,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            fields[key] = value(kind)
        infos = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(reversed(dims)), _type(kind), offset))
        alignment = int(fields.get("general.alignment", 32))
        start = -(-pos // alignment) * alignment
        whole = np.frombuffer(self._map, dtype=np.uint8)
        tensors = []
        for name, shape, (kind, block, nbytes), offset in infos:
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            row_bytes = shape[-1] // block * nbytes
            begin = start + offset
            if shape[-1] % block or begin + rows * row_bytes > len(whole):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            data = whole[begin : begin + rows * row_bytes].reshape(rows, row_bytes)
            tensors.append(GGUFTensor(name, shape, kind, data))
        return fields, tensors
