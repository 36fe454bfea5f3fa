"""Prompt caches on disk: the KV blocks of a prompt's full blocks, saved by a worker and read
back into free blocks of the same model's cache (issue 26 item 2, llama.cpp's
`/slots?action=save|restore`).

A file (one per TP rank: rank r > 0 appends `.tp{r}` to the name) is

    magic "TRDLKV01" | u32 header length | header (JSON) | payload | sha256(header + payload)

The header says what the payload is and whom it fits: `token_ids` (whole blocks), `block_size`,
`num_layers`, `num_kv_heads` (this rank's), `head_dim`, `dtype`, `tp_size`, `tp_rank`, the
model as it was named, and `fingerprint` (a hash of the model's weights: a file from other
weights under the same name is refused). The payload is, layer by layer, K then V of the
blocks in order, each `[num_kv_heads, num_blocks, block_size, head_dim]` in `dtype` (the KV
cache's, `--kv-cache-dtype`: float32, float16, bfloat16, or int8 whose rows carry 4 more bytes,
their float32 scale). A file is read back only into a cache of the same dtype: converting
would round twice, and the prefix it restores would no longer be what the cache computes.

Reading checks the header against the reader's model and cache before anything is copied,
the payload's length before reading it, and the digest at the end: the caller registers the
blocks only after a clean read, so a corrupt file never leaves KV that a prompt could hit.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

MAGIC = b"TRDLKV01"
MAX_HEADER_BYTES = 64 << 20  # a header of a million-token prompt is ~8 MB
DIGEST_BYTES = 32
_INT8_SCALE_BYTES = 4  # an int8 cache row: head_dim values, then its float32 scale
FINGERPRINT_TENSORS = 16  # the first tensors by name that the fingerprint reads ...
FINGERPRINT_VALUES = 256  # ... and the first values of each
FINGERPRINT_BYTES = 256  # a GGUF tensor's first bytes that `gguf_fingerprint` reads

Cache: TypeAlias = "torch.Tensor | np.ndarray"
"""One layer's K or V, `[num_kv_heads, blocks, block_size, head_dim]` (int8: head_dim + 4
bytes a row): the torch runner's tensors or the lean runner's numpy arrays; the file's bytes
are the same either way. torch is used only for torch tensors (so only where it is loaded)."""


class KVFileError(ValueError):
    """A prompt-cache file that cannot be used here; the message says why."""


def rank_path(path: str, tp_rank: int) -> str:
    return path if tp_rank == 0 else f"{path}.tp{tp_rank}"


def model_fingerprint(model: torch.nn.Module) -> str:
    """A hash of the model's weights (names, shapes and the first values of the first
    tensors): cheap, and different for different weights of the same shapes. (A GGUF model's
    is `gguf_fingerprint`, whichever runner holds it.)"""
    h = hashlib.sha256()
    for name, t in itertools.islice(sorted(model.state_dict().items()), FINGERPRINT_TENSORS):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().reshape(-1)[:FINGERPRINT_VALUES].float().cpu().numpy().tobytes())
    return h.hexdigest()


def gguf_fingerprint(path: str) -> str:
    """A hash of a GGUF file's weights, the same for both runners (no torch): every tensor's
    name, type and shape and the first `FINGERPRINT_BYTES` of its data, so two quantizations of
    one model differ (a page of the file per tensor is read, then let go)."""
    from treadle.model.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    h = hashlib.sha256()
    for t in gguf.tensors:
        h.update(f"{t.name}:{t.shape}:{t.kind}".encode())
        h.update(t.data.reshape(-1)[:FINGERPRINT_BYTES].tobytes())
    gguf.release_pages()
    return h.hexdigest()


def _torch_caches(kv_caches: Sequence[tuple[Cache, Cache]]) -> bool:
    """Whether the caches are torch tensors (torch is then loaded already: no import)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(kv_caches[0][0], torch.Tensor)


def read_header(path: str) -> dict[str, Any]:
    """The header of a prompt-cache file (`KVFileError` when it is not one)."""
    with open(path, "rb") as f:
        return _header(f, os.fstat(f.fileno()).st_size)[0]


def _header(f: BinaryIO, file_size: int) -> tuple[dict[str, Any], bytes]:
    head = f.read(len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
        raise KVFileError("is not a treadle prompt-cache file")
    (size,) = struct.unpack("<I", head[len(MAGIC) :])
    if size > min(MAX_HEADER_BYTES, file_size):
        raise KVFileError("has a header larger than the file")
    raw = f.read(size)
    try:
        header = json.loads(raw)
    except ValueError:
        raise KVFileError("has a header that is not JSON") from None
    if not isinstance(header, dict):
        raise KVFileError("has a header that is not a JSON object")
    tokens = header.get("token_ids")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise KVFileError("has no token ids")
    return header, raw


def layout(kv_caches: Sequence[tuple[Cache, Cache]]) -> dict[str, Any]:
    """What a file must say to fit this cache."""
    k = kv_caches[0][0]
    dtype = str(k.dtype).removeprefix("torch.")
    scale_bytes = _INT8_SCALE_BYTES if dtype == "int8" else 0
    return {
        "num_layers": len(kv_caches),
        "num_kv_heads": k.shape[0],
        "block_size": k.shape[2],
        "head_dim": k.shape[3] - scale_bytes,
        "dtype": dtype,
    }


def save_blocks(
    path: str,
    kv_caches: Sequence[tuple[Cache, Cache]],
    block_ids: list[int],
    header: dict[str, Any],
) -> int:
    """Write `block_ids`' KV with `header` (plus this cache's layout) to `path` (through a
    temporary file: a reader never sees half a file). Returns the bytes written."""
    header = {**header, **layout(kv_caches), "num_blocks": len(block_ids)}
    raw = json.dumps(header).encode()
    h = hashlib.sha256(raw)
    chunks = _torch_chunks if _torch_caches(kv_caches) else _numpy_chunks
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(raw)) + raw)
            for chunk in chunks(kv_caches, block_ids):
                h.update(chunk)
                f.write(chunk)
            f.write(h.digest())
            written = f.tell()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return written


def _torch_chunks(
    kv_caches: Sequence[tuple[Cache, Cache]], block_ids: list[int]
) -> Iterable[bytes]:
    import torch

    ids = torch.tensor(block_ids, dtype=torch.long)
    for k, v in kv_caches:
        for cache in (k, v):
            assert isinstance(cache, torch.Tensor)
            data = cache.index_select(1, ids.to(cache.device)).cpu().contiguous()
            yield data.view(torch.uint8).numpy().tobytes()


def _numpy_chunks(
    kv_caches: Sequence[tuple[Cache, Cache]], block_ids: list[int]
) -> Iterable[bytes]:
    ids = np.asarray(block_ids, dtype=np.int64)
    for k, v in kv_caches:
        for cache in (k, v):
            yield np.ascontiguousarray(np.asarray(cache)[:, ids]).tobytes()


def load_blocks(
    path: str,
    kv_caches: Sequence[tuple[Cache, Cache]],
    targets: dict[int, int],
    expected: dict[str, Any],
) -> int:
    """Copy blocks of the file into the cache: `targets` maps a block's index in the file to a
    block id of the cache. `expected`: header fields that must match (model fingerprint, TP
    layout). Raises `KVFileError` saying what does not fit; returns the bytes read."""
    want = {**layout(kv_caches), **expected}
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        header, raw = _header(f, file_size)
        for key, value in want.items():
            if header.get(key) != value:
                saved = header.get("model", "another model")
                if key == "dtype":
                    flag = "auto" if header.get(key) == "float32" else header.get(key)
                    raise KVFileError(
                        f"was saved from a {header.get(key)} KV cache ({saved}), this server's "
                        f"is {value} (--kv-cache-dtype): restart with --kv-cache-dtype {flag} "
                        "to read it, or save it again"
                    )
                raise KVFileError(
                    f"was saved for {key} {header.get(key)!r} ({saved}), this server has {value!r}"
                )
        n = header.get("num_blocks")
        if not isinstance(n, int) or n * want["block_size"] != len(header["token_ids"]):
            raise KVFileError("says a number of blocks that its tokens do not fill")
        if any(not 0 <= i < n for i in targets):
            raise KVFileError("has fewer blocks than asked for")
        k0 = kv_caches[0][0]
        per_block = k0.shape[0] * k0.shape[2] * k0.shape[3] * k0.itemsize  # int8: + scales
        payload = 2 * len(kv_caches) * n * per_block
        if file_size != len(MAGIC) + 4 + len(raw) + payload + DIGEST_BYTES:
            raise KVFileError(f"is {file_size} bytes, not what its header says (truncated?)")
        h = hashlib.sha256(raw)
        copy = _torch_copy if _torch_caches(kv_caches) else _numpy_copy
        for k, v in kv_caches:
            for cache in (k, v):
                chunk = f.read(n * per_block)
                h.update(chunk)
                copy(chunk, n, cache, targets)
        if f.read(DIGEST_BYTES) != h.digest():
            raise KVFileError("is corrupt (its checksum does not match)")
    return file_size


def _torch_copy(chunk: bytes, n: int, cache: Cache, targets: dict[int, int]) -> None:
    """Copy the `targets` blocks of `chunk` (`n` blocks of the cache's layout) into `cache`."""
    import torch

    assert isinstance(cache, torch.Tensor)
    src = torch.tensor(list(targets), dtype=torch.long)
    dst = torch.tensor(list(targets.values()), dtype=torch.long, device=cache.device)
    data = torch.frombuffer(bytearray(chunk), dtype=cache.dtype).view(
        cache.shape[0], n, cache.shape[2], cache.shape[3]
    )
    cache.index_copy_(1, dst, data.index_select(1, src).to(cache.device))


def _numpy_copy(chunk: bytes, n: int, cache: Cache, targets: dict[int, int]) -> None:
    assert isinstance(cache, np.ndarray)
    data = np.frombuffer(chunk, dtype=cache.dtype).reshape(
        cache.shape[0], n, cache.shape[2], cache.shape[3]
    )
    cache[:, list(targets.values())] = data[:, list(targets)]
