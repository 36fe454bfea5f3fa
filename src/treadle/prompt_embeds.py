"""`prompt_embeds` from strangers (issue 23): base64 of `torch.save(tensor)`, read without
`torch.load` and without unpickling anything.

vLLM decodes the field with `torch.load`, which unpickles: a crafted sparse tensor wrote out of
bounds (CVE-2025-62164), and a ~1.5 KB payload densified to 4 TiB. Here the `torch.save` zip
is read by hand and its `data.pkl` is never executed: its opcodes (`pickletools.genops`, which
only parses) must spell exactly one call of `torch._utils._rebuild_tensor_v2` on one storage,
with nothing else reachable. Accepted: one plain dense tensor of float32, float16 or bfloat16,
2-D, rows contiguous, `[rows, hidden_size]` with `1 <= rows <= max_rows`, little-endian,
stored (not compressed), every value finite. The base64 length is capped before decoding and
every size is checked against the bytes actually there before anything is allocated.
Anything else: `InvalidRequest` naming `prompt_embeds`.

A tensor that arrives as one (the offline `LLM`, and the engine core, whose socket is
untrusted) passes the same checks in `check_tensor`. Such a prompt has no token ids: its
`prompt_token_ids` are `placeholder_ids` (zeros, one per row) for the scheduler's counts.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import pickletools
import zipfile
from typing import TYPE_CHECKING, Any

from treadle.validation import InvalidRequest

if TYPE_CHECKING:
    import torch

PARAM = "prompt_embeds"
# torch's storage classes -> their dtypes' names (torch is imported only when a tensor is read:
# the API server loads it on its first prompt_embeds, issue 41 item 2).
_STORAGES = {
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
}
_REBUILD = "torch._utils _rebuild_tensor_v2"
_ORDERED_DICT = "collections OrderedDict"
_ZIP_OVERHEAD = 4096  # the zip's headers and data.pkl, generously
_MAX_PICKLE = 1024  # a single tensor's data.pkl is ~160 bytes


class _Storage:
    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _Global:
    def __init__(self, name: str) -> None:
        self.name = name


class _Empty:
    """`OrderedDict()`: the (empty) backward hooks."""


def disabled() -> InvalidRequest:
    return InvalidRequest(
        PARAM,
        "are not accepted by this server: start it with --enable-prompt-embeds "
        "(offline: LLM(..., enable_prompt_embeds=True))",
    )


def placeholder_ids(num_rows: int) -> list[int]:
    """The prompt token ids of an embeddings prompt: its rows' count, never looked up."""
    return [0] * num_rows


def check_tensor(tensor: object, hidden_size: int, max_rows: int) -> torch.Tensor:
    """`tensor` if it is what `decode` accepts (dense, contiguous, 2-D `[rows, hidden_size]`
    with `1 <= rows <= max_rows`, float32/float16/bfloat16, finite, on the CPU); else
    `InvalidRequest` naming `prompt_embeds`."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequest(PARAM, f"must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        raise _refuse(f"a {tensor.layout} tensor on {tensor.device}: give a dense CPU tensor")
    if str(tensor.dtype).removeprefix("torch.") not in _STORAGES.values():
        raise _refuse(f"dtype {tensor.dtype}: give float32, float16 or bfloat16")
    if tensor.dim() != 2:
        raise _refuse(f"{tensor.dim()}-D; prompt_embeds are [tokens, hidden_size]")
    rows, cols = tensor.shape
    if cols != hidden_size:
        raise _refuse(f"shape [{rows}, {cols}]: this model's hidden size is {hidden_size}")
    if not 1 <= rows <= max_rows:
        raise _refuse(f"{rows} rows: between 1 and {max_rows} (the maximum context length)")
    if not tensor.is_contiguous():
        raise _refuse("the tensor must be contiguous")
    if not bool(torch.isfinite(tensor).all()):
        raise _refuse("it holds NaN or infinite values")
    return tensor


def _refuse(why: str) -> InvalidRequest:
    return InvalidRequest(PARAM, f"is not a tensor treadle takes: {why}")


def max_base64_chars(hidden_size: int, max_rows: int) -> int:
    """The longest base64 a `[max_rows, hidden_size]` float32 tensor can need."""
    return 4 * math.ceil((max_rows * hidden_size * 4 + _ZIP_OVERHEAD) / 3)


def decode(data: str, hidden_size: int, max_rows: int) -> torch.Tensor:
    """The `[rows, hidden_size]` tensor in `data` (base64 of `torch.save`), in its own dtype."""
    if not isinstance(data, str):
        raise InvalidRequest(PARAM, "must be a base64 string (of torch.save(tensor))")
    if len(data) > max_base64_chars(hidden_size, max_rows):
        raise _refuse(
            f"{len(data)} base64 characters, more than a [{max_rows}, {hidden_size}] float32 "
            "tensor needs"
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(PARAM, f"is not valid base64: {e}") from e
    return read_torch_save(raw, hidden_size, max_rows)


def read_torch_save(raw: bytes, hidden_size: int, max_rows: int) -> torch.Tensor:
    import torch

    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
        entries = {info.filename: info for info in archive.infolist()}
    except Exception as e:  # zipfile raises many kinds on a damaged archive: all are "no"
        raise _refuse(f"not a torch.save zip ({e})") from e
    pickles = [name for name in entries if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise _refuse("no single <archive>/data.pkl")
    root = pickles[0][: -len("data.pkl")]
    for info in entries.values():
        if not info.filename.startswith(root):
            raise _refuse(f"an entry outside {root!r}: {info.filename!r}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise _refuse(f"{info.filename!r} is compressed (torch.save stores)")
    byteorder = entries.get(root + "byteorder")
    if byteorder is not None and _read(archive, byteorder, 16) != b"little":
        raise _refuse("not little-endian")
    pickle = _read(archive, entries[root + "data.pkl"], _MAX_PICKLE)
    storage, offset, size, stride = _rebuild_call(pickle)
    if len(size) != 2:
        raise _refuse(f"{len(size)}-D; prompt_embeds are [tokens, hidden_size]")
    rows, cols = size
    if cols != hidden_size:
        raise _refuse(f"shape [{rows}, {cols}]: this model's hidden size is {hidden_size}")
    if not 1 <= rows <= max_rows:
        raise _refuse(f"{rows} rows: between 1 and {max_rows} (the maximum context length)")
    if stride != (cols, 1):
        raise _refuse(f"strides {stride}: the tensor must be contiguous")
    if offset < 0 or offset + rows * cols > storage.numel:
        raise _refuse("the tensor runs past its storage")
    stored = entries.get(f"{root}data/{storage.key}")
    nbytes = storage.numel * storage.dtype.itemsize
    if stored is None or stored.file_size != nbytes or nbytes > len(raw):
        raise _refuse("its storage's bytes are missing or of the wrong size")
    flat = torch.frombuffer(bytearray(_read(archive, stored, nbytes)), dtype=storage.dtype)
    tensor = flat[offset : offset + rows * cols].view(rows, cols).clone()
    if not bool(torch.isfinite(tensor).all()):
        raise _refuse("it holds NaN or infinite values")
    return tensor


def _read(archive: zipfile.ZipFile, info: zipfile.ZipInfo, most: int) -> bytes:
    if info.file_size > most:
        raise _refuse(f"{info.filename!r} is {info.file_size} bytes, more than {most}")
    try:
        with archive.open(info) as f:
            data = f.read(most + 1)
    except Exception as e:  # (NotImplementedError for odd flags, RuntimeError if encrypted, ...)
        raise _refuse(f"{info.filename!r} cannot be read ({e})") from e
    if len(data) != info.file_size:
        raise _refuse(f"{info.filename!r} is not the size its header says")
    return data


def _rebuild_call(pickle: bytes) -> tuple[_Storage, int, tuple[int, ...], tuple[int, ...]]:
    """The arguments of the one `_rebuild_tensor_v2(storage, offset, size, stride,
    requires_grad, hooks)` call `pickle` spells; anything else refused. Nothing is executed:
    the opcodes are read and their values checked on a small stack."""
    stack: list[Any] = []
    marks: list[int] = []
    result: Any = None
    try:
        for op, arg, _ in pickletools.genops(pickle):
            name = op.name
            if name in ("PROTO", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                continue
            if name == "GLOBAL":
                named = str(arg)
                if named not in (_REBUILD, _ORDERED_DICT) and not (
                    named.startswith("torch ") and named[6:] in _STORAGES
                ):
                    raise _refuse(f"it names {named!r}")
                stack.append(_Global(named))
            elif name == "MARK":
                marks.append(len(stack))
            elif name in (
                "BINUNICODE",
                "SHORT_BINUNICODE",
                "BININT",
                "BININT1",
                "BININT2",
                "LONG1",
            ):
                stack.append(arg)
            elif name in ("NEWFALSE", "NEWTRUE"):
                stack.append(name == "NEWTRUE")
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif name == "TUPLE":
                start = marks.pop()
                items = tuple(stack[start:])
                del stack[start:]
                stack.append(items)
            elif name == "BINPERSID":
                stack.append(_persistent(stack.pop()))
            elif name == "REDUCE":
                args, fn = stack.pop(), stack.pop()
                stack.append(_reduce(fn, args))
            elif name == "STOP":
                if len(stack) != 1 or marks:
                    raise _refuse("its pickle leaves more than one object")
                result = stack.pop()
            else:
                raise _refuse(f"its pickle uses {name}")
    except InvalidRequest:
        raise
    except (ValueError, IndexError, TypeError) as e:
        raise _refuse(f"its pickle cannot be read ({e})") from e
    if not (isinstance(result, tuple) and len(result) == 4 and isinstance(result[0], _Storage)):
        raise _refuse("its pickle is not one tensor")
    return result  # type: ignore[return-value]


def _persistent(pid: Any) -> _Storage:
    """`('storage', torch.<Dtype>Storage, key, 'cpu', numel)`."""
    if not (
        isinstance(pid, tuple)
        and len(pid) == 5
        and pid[0] == "storage"
        and isinstance(pid[1], _Global)
        and pid[1].name.startswith("torch ")
        and pid[1].name[6:] in _STORAGES
        and isinstance(pid[2], str)
        and pid[2].isascii()
        and pid[2].isdigit()
        and pid[3] == "cpu"
        and _is_count(pid[4])
    ):
        raise _refuse("its storage is not a plain CPU storage")
    import torch

    return _Storage(getattr(torch, _STORAGES[pid[1].name[6:]]), pid[2], pid[4])


def _reduce(fn: Any, args: Any) -> Any:
    if not isinstance(fn, _Global) or not isinstance(args, tuple):
        raise _refuse("its pickle calls something other than the tensor's rebuild")
    if fn.name == _ORDERED_DICT:
        if args != ():
            raise _refuse("its backward hooks are not empty")
        return _Empty()
    if fn.name != _REBUILD or len(args) != 6:
        raise _refuse("its pickle calls something other than the tensor's rebuild")
    storage, offset, size, stride, requires_grad, hooks = args
    if not (
        isinstance(storage, _Storage)
        and _is_count(offset)
        and _is_shape(size)
        and _is_shape(stride)
        and isinstance(requires_grad, bool)
        and isinstance(hooks, _Empty)
    ):
        raise _refuse("its rebuild arguments are not those of a plain dense tensor")
    return storage, offset, size, stride


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 40


def _is_shape(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) <= 8 and all(_is_count(v) for v in value)
