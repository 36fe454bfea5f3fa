"""CPU fast paths: prepacked oneDNN weights for the linear layers, and a small C kernel for
decode attention that reads the paged KV cache in place.

Linear layers: PyTorch's default CPU GEMM is fast for one row (a GEMV) but slow for a few
rows (at 4-32 rows, 1.5-2x slower than oneDNN with a prepacked weight: the rows of a decode
batch). Each linear layer keeps a oneDNN-packed copy of its weight (`pack_weight`, made once
after loading) and `linear` uses it from `PACKED_MIN_ROWS` rows up (and always in bfloat16,
where the stock kernel is slow at any size); the weight memory doubles.

Attention:
The PyTorch path gathers every decoding request's context blocks into a contiguous buffer per
layer (an `index_select` as large as the whole context, then two matmuls over it, padded to
the longest request). This kernel walks each request's block table instead and reads every
K/V row once, only up to the request's own length: one task per (request, KV head), the
query heads of that KV head together, in float32.

It is compiled on first use with the system C compiler (`cc -O3 -march=native -fopenmp`, about
a second) into `~/.cache/treadle/kernels/`, and loaded with ctypes (which releases the GIL
during the call). OpenMP resolves to the `libgomp.so.1` that PyTorch already loaded, so both
share one thread pool. Without a compiler, or with `TREADLE_CPU_KERNELS=0`, attention stays
on the PyTorch path.
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

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (Cephes' expf: Cody-Waite reduction and a degree-6 polynomial, about
   1 ulp), written so that the compiler vectorizes the loops that call it. */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* Ask for a block's rows ahead of use: blocks lie anywhere in the cache, so the hardware
   prefetcher cannot guess the next one. */
static inline void prefetch_block(const float* block, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(block + i, 0, 1);
}

static inline float dot(const float* a, const float* b, int64_t n) {
    float s = 0.f;
    #pragma omp simd reduction(+:s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

void paged_decode_attention_f32(
    const float* q, int64_t q_row_stride,          /* q[r, head, :] at q + r*stride + head*d */
    const float* k_cache, const float* v_cache,    /* [num_kv, num_blocks, block_size, d] */
    const int64_t* block_table, int64_t table_stride,
    const int32_t* lens,                           /* context tokens of each request */
    float* out, int64_t out_row_stride,            /* out[r, head*d + i] */
    int64_t num_reqs, int64_t num_heads, int64_t num_kv, int64_t head_dim,
    int64_t num_blocks, int64_t block_size, float scale, int64_t max_len, int num_threads)
{
    const int64_t group = num_heads / num_kv;
    const int64_t head_stride = num_blocks * block_size * head_dim;
    #pragma omp parallel num_threads(num_threads)
    {
        float* scores = (float*)malloc(sizeof(float) * group * max_len);
        float* acc = (float*)malloc(sizeof(float) * group * head_dim);
        #pragma omp for collapse(2) schedule(dynamic, 4)
        for (int64_t r = 0; r < num_reqs; r++) {
            for (int64_t h = 0; h < num_kv; h++) {
                const int64_t len = lens[r];
                const int64_t* table = block_table + r * table_stride;
                const float* qh = q + r * q_row_stride + h * group * head_dim;
                const float* kh = k_cache + h * head_stride;
                const float* vh = v_cache + h * head_stride;
                const int64_t num_used = (len + block_size - 1) / block_size;
                const int64_t block_floats = block_size * head_dim;
                prefetch_block(kh + table[0] * block_floats, block_floats);
                for (int64_t b = 0, t = 0; t < len; b++) {
                    const float* kb = kh + table[b] * block_floats;
                    if (b + 1 < num_used) prefetch_block(kh + table[b + 1] * block_floats, block_floats);
                    else prefetch_block(vh + table[0] * block_floats, block_floats);
                    const int64_t n = len - t < block_size ? len - t : block_size;
                    for (int64_t o = 0; o < n; o++, t++)
                        for (int64_t j = 0; j < group; j++)
                            scores[j * max_len + t] =
                                dot(qh + j * head_dim, kb + o * head_dim, head_dim) * scale;
                }
                for (int64_t j = 0; j < group; j++) {
                    float* s = scores + j * max_len;
                    float m = s[0];
                    for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
                    float total = 0.f;
                    #pragma omp simd reduction(+:total)
                    for (int64_t t = 0; t < len; t++) {
                        s[t] = exp_nonpositive(s[t] - m);
                        total += s[t];
                    }
                    const float inv = 1.f / total;
                    for (int64_t t = 0; t < len; t++) s[t] *= inv;
                }
                memset(acc, 0, sizeof(float) * group * head_dim);
                for (int64_t b = 0, t = 0; t < len; b++) {
                    const float* vb = vh + table[b] * block_floats;
                    if (b + 1 < num_used) prefetch_block(vh + table[b + 1] * block_floats, block_floats);
                    const int64_t n = len - t < block_size ? len - t : block_size;
                    for (int64_t o = 0; o < n; o++, t++) {
                        const float* vt = vb + o * head_dim;
                        for (int64_t j = 0; j < group; j++) {
                            const float p = scores[j * max_len + t];
                            float* a = acc + j * head_dim;
                            for (int64_t i = 0; i < head_dim; i++) a[i] += p * vt[i];
                        }
                    }
                }
                for (int64_t j = 0; j < group; j++)
                    memcpy(out + r * out_row_stride + (h * group + j) * head_dim,
                           acc + j * head_dim, sizeof(float) * head_dim);
            }
        }
        free(scores);
        free(acc);
    }
}
"""

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # [] = not tried yet


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "treadle" / "kernels"


def _compile() -> ctypes.CDLL:
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention_{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "kernel.c"
            src.write_text(_SOURCE)
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
                        "CPU attention kernel unavailable (%s%s); using the PyTorch path",
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
