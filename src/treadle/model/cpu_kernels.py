"""CPU fast paths: prepacked oneDNN weights for the linear layers, and treadle's C kernels
(`csrc/cpu_kernels.c`) for decode attention, GGUF-block linear layers (`quantized.py`) and the
small per-layer operations.

Linear layers: PyTorch's default CPU GEMM is fast for one row (a GEMV) but slow for a few
rows (at 4-32 rows, 1.5-2x slower than oneDNN with a prepacked weight: the rows of a decode
batch). Each linear layer keeps a oneDNN-packed copy of its weight (`pack_weight`, made once
after loading) and `linear` uses it from `PACKED_MIN_ROWS` rows up (and always in bfloat16,
where the stock kernel is slow at any size); the weight memory doubles. Layers loaded from
GGUF blocks use those up to `quantized.MAX_ROWS` rows instead, and then free the plain weight
(layers.py), which no call reads any more.

Attention: the PyTorch path gathers every decoding request's context blocks into a contiguous
buffer per layer (an `index_select` as large as the whole context, then two matmuls over it,
padded to the longest request). The kernel walks each request's block table instead and reads
every K/V row once, only up to the request's own length: one task per (request, KV head), the
query heads of that KV head together, in float32.

Small ops (`small_ops`): RMSNorm, residual add + RMSNorm, RoPE in place, SiLU * up and the KV
cache write, one C call each instead of 2-10 PyTorch ops (each costs more to dispatch than to
compute at decode sizes); float32 on the CPU only.

The kernels are compiled on first use with the system C compiler (`cc -O3 -march=native
-fopenmp`, about a second) into `~/.cache/treadle/kernels/`, and loaded with ctypes (which
releases the GIL during the call). OpenMP resolves to the `libgomp.so.1` that PyTorch already
loaded, so both share one thread pool. Without a compiler, or with `TREADLE_CPU_KERNELS=0`,
everything stays on the PyTorch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from treadle import envs
from treadle.logger import init_logger

logger = init_logger(__name__)

_SOURCE_FILE = Path(__file__).parent / "csrc" / "cpu_kernels.c"

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # [] = not tried yet


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "treadle" / "kernels"


def _compile() -> ctypes.CDLL:
    source = _SOURCE_FILE.read_text()
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels_{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "kernel.c"
            src.write_text(source)
            built = Path(tmp) / "kernel.so"
            cmd = [
                os.environ.get("CC", "cc"),
                "-O3",
                "-march=native",
                "-fopenmp",
                "-fno-math-errno",
                "-shared",
                "-fPIC",
                str(src),
                "-o",
                str(built),
            ]
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            os.replace(built, target)  # atomic: a concurrent process sees all of it or nothing
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64]
    fn.argtypes += [i64] * 6 + [ctypes.c_float, i64, ctypes.c_int]
    fn.restype = None
    f32, c_int = ctypes.c_float, ctypes.c_int
    signatures = {
        "gguf_linear_f32": [ptr, i64, i64, i64, ptr, c_int, i64, ptr, i64, c_int],
        "rms_norm_f32": [ptr, i64, i64, i64, ptr, f32, ptr, i64, c_int],
        "add_rms_norm_f32": [ptr, ptr, i64, i64, ptr, f32, ptr, c_int],
        "rope_f32": [ptr, i64, i64, i64, i64, ptr, ptr, c_int],
        "silu_and_mul_f32": [ptr, i64, i64, ptr, c_int],
        "write_kv_f32": [ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, or turned off); tried once per process."""
    with _lock:
        if not _loaded:
            lib = None
            if envs.cpu_kernels():
                try:
                    lib = _compile()
                except (OSError, subprocess.SubprocessError) as e:
                    detail = getattr(e, "stderr", b"") or b""
                    logger.warning(
                        "CPU kernels unavailable (%s%s); using the PyTorch paths",
                        e,
                        (": " + detail.decode(errors="replace")[-500:]) if detail else "",
                    )
            _loaded.append(lib)
        return _loaded[0]


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles this call: float32 on the CPU, head size a multiple of 16."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and q.shape[-1] % 16 == 0
        and k_cache.is_contiguous()
        and load() is not None
    )


def paged_decode_attention(
    q: torch.Tensor,  # [D, H, d], rows may be strided, heads contiguous
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, d]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [D, nb] int64
    lens: torch.Tensor,  # [D] int32
    max_len: int,
    out: torch.Tensor,  # [D, H * d], rows may be strided
    scale: float,
) -> None:
    lib = load()
    assert lib is not None
    num_reqs, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    num_kv, num_blocks, block_size, _ = k_cache.shape
    lib.paged_decode_attention_f32(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.stride(0),
        lens.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        num_reqs,
        num_heads,
        num_kv,
        head_dim,
        num_blocks,
        block_size,
        scale,
        max_len,
        torch.get_num_threads(),
    )


PACKED_MIN_ROWS = 3  # below this, float32 stays on PyTorch's GEMV (faster at 1-2 rows)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a `[out, in]` weight, or None where it does not apply."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not envs.cpu_kernels()
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError) as e:  # a build without these ops
        logger.info("oneDNN weight packing unavailable (%s); using F.linear", e)
        return None
    return packed


def use_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether `x` goes through the packed weight: the faster path for its rows and dtype."""
    return (
        packed is not None
        and x.dim() == 2
        and (x.shape[0] >= PACKED_MIN_ROWS or x.dtype == torch.bfloat16)
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """x W^T (+ b), through the packed weight where that is faster."""
    if use_packed(x, packed):
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), packed, bias, "none", [], ""
        )
        return out
    return F.linear(x, weight, bias)


# ---- The small per-layer operations (rows of a step; see csrc/cpu_kernels.c) -----------------


def small_ops(x: torch.Tensor) -> bool:
    """Whether the C versions of the small per-layer ops take `x`: float32 on the CPU."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None


def _lib() -> ctypes.CDLL:
    lib = load()
    assert lib is not None
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, n] (rows may be strided) -> RMSNorm(x) * weight, a new tensor."""
    rows, n = x.shape
    out = torch.empty(rows, n)
    _lib().rms_norm_f32(
        x.data_ptr(), x.stride(0), rows, n, weight.data_ptr(), eps, out.data_ptr(), n,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def add_rms_norm(
    residual: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += y (in place, both [T, n] contiguous); returns RMSNorm(residual) * weight."""
    rows, n = residual.shape
    out = torch.empty(rows, n)
    _lib().add_rms_norm_f32(
        residual.data_ptr(), y.data_ptr(), rows, n, weight.data_ptr(), eps, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox RoPE in place on x [T, H, d] (heads contiguous, rows may be strided); cos/sin are
    the tokens' rows, [T, d] contiguous (or [T, 1, d])."""
    rows, heads, d = x.shape
    _lib().rope_f32(
        x.data_ptr(), x.stride(0), rows, heads, d, cos.data_ptr(), sin.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2n] contiguous, gate then up -> silu(gate) * up, [T, n]."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n)
    _lib().silu_and_mul_f32(gate_up.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads())
    return out


def write_kv(
    k: torch.Tensor,  # [T, Hkv, d], rows `stride(0)` apart, as v
    v: torch.Tensor,
    slots: torch.Tensor,  # [T] int64
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, d] contiguous
    v_cache: torch.Tensor,
) -> None:
    rows, num_kv, d = k.shape
    _lib().write_kv_f32(
        k.data_ptr(), v.data_ptr(), k.stride(0), rows, num_kv, d, slots.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1] * k_cache.shape[2],
    )  # fmt: skip
