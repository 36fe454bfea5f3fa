"""treadle's C kernels for the CPU (`csrc/`): which ISA level to use, one library per level
(built and cached by `kernel_build.py`), and typed calls into it.

The kernels: decode/prefill attention over the paged KV cache (`paged_decode_attention`; the
cache in float32, float16, bfloat16 or int8, `KV_TYPES`),
linear layers on GGUF blocks (`gguf_linear`, see `quantized.py`; float32 activations, or int8
ones with integer dot products: `with_activations`) and the small per-layer ops
(RMSNorm, add + RMSNorm, RoPE, SiLU * up, the KV write), and the structured-output
bitmask applied to the logits, float32 throughout but for the int8 activations.

The ISA levels and how one is chosen (`TREADLE_CPU_ISA`, else the best this CPU runs),
the C signatures and the fused decode's structs are `kernel_lib.py`'s (no torch there);
`TREADLE_CPU_ISA` below the CPU's best also makes `treadle/__init__.py` cap PyTorch's and
oneDNN's own kernels at that level, so the whole process behaves as on such a CPU. Each
level is compiled with its own flags, never `-march=native`, into
`$TREADLE_CACHE_DIR/kernels` (default `~/.cache/treadle`), named by a hash of the sources,
the level, the flags and the compiler: a cache shared between machines never hands one CPU a
library built for another. The library says which level it was built for
(`treadle_kernel_isa`), and that is checked on load.

The model asks once, at load time, whether it runs on these kernels (`for_model`: float32 on
the CPU, a compiler present, `TREADLE_CPU_KERNELS` not 0) and then calls the `Kernels` object
it was given; nothing here is looked up per call. The calls release the GIL (ctypes), and
OpenMP resolves to the `libgomp.so.1` PyTorch already loaded, so both share one thread pool.
"""

from __future__ import annotations

import copy
import subprocess
import threading
from pathlib import Path

import torch

from treadle import envs
from treadle.config import CPU_ACTIVATION_DTYPES
from treadle.logger import init_logger
from treadle.model import kernel_lib
from treadle.model.kernel_build import build as _build
from treadle.model.kernel_lib import ISA_LEVELS as ISA_LEVELS
from treadle.model.kernel_lib import available_isas as available_isas
from treadle.model.kernel_lib import detect_isa as detect_isa
from treadle.model.kernel_lib import select_isa as select_isa

logger = init_logger(__name__)

# The KV cache's element types as the kernels number them (`kernel_lib.KV_F32` ...).
KV_TYPES = {
    torch.float32: kernel_lib.KV_F32,
    torch.float16: kernel_lib.KV_F16,
    torch.bfloat16: kernel_lib.KV_BF16,
    torch.int8: kernel_lib.KV_I8,
}


def kv_type(cache: torch.Tensor) -> int:
    """The kernels' number for a KV cache tensor's element type (ValueError for another)."""
    try:
        return KV_TYPES[cache.dtype]
    except KeyError:
        raise ValueError(f"no CPU kernel reads a KV cache of {cache.dtype}") from None


# The GGUF-block product of each integer activation dtype: int8 blocks of 32 (`csrc/int8.h`), or
# each row as two int8 rows, its blocks and what their rounding left (`int8x2`: nearly
# float32's product).
INT8_LINEAR = {"int8": "gguf_linear_i8", "int8x2": "gguf_linear_i8x2"}


class Kernels:
    """One ISA level's compiled library, with a typed method per kernel. `activations`: how
    the GGUF-block linear layers take their input (`gguf_linear` and the fused decode):
    float32 (exact), or int8 blocks of 32 with integer dot products (`csrc/int8.h`)."""

    def __init__(self, isa: str, path: Path) -> None:
        self.isa = isa
        self.path = path
        self.activations = "float32"
        lib = kernel_lib.open_library(isa, path)
        # rows up to which int8 activations take the integer dot products (beyond: float32)
        self.int8_max_rows = int(lib.gguf_linear_i8_max_rows())
        self.g16_kinds = kernel_lib.g16_kinds(lib)
        self._lib = lib
        # Raw: its arguments are the structs fused_decode.py lays out.
        self.decode_layers = lib.decode_layers_f32
        self._gguf_linear = lib.gguf_linear_f32

    def with_activations(self, dtype: str) -> Kernels:
        """The same library with the GGUF-block linear layers on `dtype` activations (one of
        `CPU_ACTIVATION_DTYPES`); self where that is already so."""
        if dtype not in CPU_ACTIVATION_DTYPES:
            raise ValueError(f"activation dtype {dtype!r}: choose one of {CPU_ACTIVATION_DTYPES}")
        if dtype == self.activations:
            return self
        other = copy.copy(self)
        other.activations = dtype
        other._gguf_linear = getattr(self._lib, INT8_LINEAR.get(dtype, "gguf_linear_f32"))
        return other

    def paged_decode_attention(
        self,
        q: torch.Tensor,  # [D, H, d], rows may be strided, heads contiguous
        k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, d] (int8: d + 4, see KV_TYPES)
        v_cache: torch.Tensor,
        block_table: torch.Tensor,  # [D, nb] int64 (row stride 0 allowed)
        lens: torch.Tensor,  # [D] int32
        max_len: int,
        out: torch.Tensor,  # [D, H * d], rows may be strided
        scale: float,
    ) -> None:
        num_reqs, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        num_kv, num_blocks, block_size, _ = k_cache.shape
        self._lib.paged_decode_attention_f32(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_table.data_ptr(), block_table.stride(0), lens.data_ptr(), out.data_ptr(),
            out.stride(0), num_reqs, num_heads, num_kv, head_dim, num_blocks, block_size, scale,
            max_len, torch.get_num_threads(), kv_type(k_cache),
        )  # fmt: skip

    def gguf_linear(
        self, x: torch.Tensor, tiles: torch.Tensor, kind: int, out_features: int
    ) -> torch.Tensor:
        """x [M, K] (rows may be strided) times a weight in the tiled GGUF layout, x taken as
        `self.activations`."""
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        out = torch.empty(rows, out_features, dtype=torch.float32)
        self._gguf_linear(
            x.data_ptr(), x.stride(0), rows, k, tiles.data_ptr(), kind, out_features,
            out.data_ptr(), out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def gguf_dequantize(
        self, tiles: torch.Tensor, kind: int, out_features: int, out: torch.Tensor
    ) -> torch.Tensor:
        """The weight `[out_features, K]` in float32 from its tiles, into `out` (contiguous,
        at least that many elements); returns that view of `out`."""
        k = tiles.shape[1] * 32
        w = out[: out_features * k].view(out_features, k)
        self._lib.gguf_dequantize_f32(
            tiles.data_ptr(), kind, out_features, k, w.data_ptr(), torch.get_num_threads()
        )
        return w

    def gguf_rows(
        self, tiles: torch.Tensor, kind: int, out_features: int, ids: torch.Tensor
    ) -> torch.Tensor:
        """Rows `ids` of a weight in GGUF blocks (tiles or 16 wide) as float32 `[len(ids), K]`:
        the values of `QuantizedWeight.dequantize_rows` (gguf's), in one call (an embedding
        lookup per step). An id outside the weight gives zeros."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        k = tiles.shape[1] * 32
        out = torch.empty(len(ids), k)
        self._lib.gguf_dequantize_rows_f32(
            tiles.data_ptr(), kind, out_features, k, ids.data_ptr(), len(ids), out.data_ptr()
        )
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, n] (rows may be strided) -> RMSNorm(x) * weight, a new tensor."""
        rows, n = x.shape
        out = torch.empty(rows, n)
        self._lib.rms_norm_f32(
            x.data_ptr(), x.stride(0), rows, n, weight.data_ptr(), eps, out.data_ptr(), n,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, residual: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += y (in place, both [T, n] contiguous); returns RMSNorm(residual) * weight."""
        rows, n = residual.shape
        out = torch.empty(rows, n)
        self._lib.add_rms_norm_f32(
            residual.data_ptr(), y.data_ptr(), rows, n, weight.data_ptr(), eps, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Neox RoPE in place on x [T, H, d] (heads contiguous, rows may be strided); cos/sin
        are the tokens' rows, [T, d] contiguous (or [T, 1, d])."""
        rows, heads, d = x.shape
        self._lib.rope_f32(
            x.data_ptr(), x.stride(0), rows, heads, d, cos.data_ptr(), sin.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2n] contiguous, gate then up -> silu(gate) * up, [T, n]."""
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, n)
        self._lib.silu_and_mul_f32(
            gate_up.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads()
        )
        return out

    def lora_apply(
        self,
        x: torch.Tensor,  # [rows, in] float32, rows `stride(0)` apart
        slot: torch.Tensor,  # [rows] int64: each row's adapter slot, -1 for none
        a: torch.Tensor,  # [slots, w, in] float32 contiguous
        b_t: torch.Tensor,  # [slots, w, n_out] float32 contiguous, scaled
        out: torch.Tensor,  # [rows, n_out] float32, rows `stride(0)` apart: updated in place
    ) -> None:
        """Each row's LoRA update added to `out`, its own adapter's only (`model/lora.py`)."""
        self._lib.lora_apply_f32(
            x.data_ptr(), x.stride(0), x.shape[0], slot.data_ptr(), a.data_ptr(),
            b_t.data_ptr(), a.shape[2], a.shape[1], b_t.shape[2], out.data_ptr(),
            out.stride(0), torch.get_num_threads(),
        )  # fmt: skip

    def write_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, d], heads contiguous, rows `stride(0)` apart
        v: torch.Tensor,  # the same shape, its own row stride
        slots: torch.Tensor,  # [T] int64
        k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, d] contiguous (int8: d + 4)
        v_cache: torch.Tensor,
    ) -> None:
        """k and v (float32) into the cache's rows, rounded (float16, bfloat16) or quantized
        (int8: rint(x * 127 / max|x|) per row, the row's max|x| / 127 beside it)."""
        rows, num_kv, d = k.shape
        self._lib.write_kv_f32(
            k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), rows, num_kv, d,
            slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            k_cache.shape[1] * k_cache.shape[2], kv_type(k_cache),
        )  # fmt: skip

    def apply_token_bitmask_(
        self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
    ) -> None:
        """Structured outputs, in place on float32 logits [R, vocab] (rows may be strided):
        -inf at the tokens that int32 bitmask row i (`structured_outputs.fill_bitmask`) does
        not allow in logits row rows[i] (int64); a row that would keep no finite logit gets 0
        at the allowed tokens instead (as the sampler's PyTorch path)."""
        assert logits.dtype == torch.float32 and logits.stride(1) == 1
        rows = rows.to(torch.int64).contiguous()
        bitmask = bitmask.to(torch.int32).contiguous()
        self._lib.apply_token_bitmask_f32(
            logits.data_ptr(), logits.stride(0), rows.data_ptr(), rows.shape[0],
            bitmask.data_ptr(), bitmask.shape[1], logits.shape[1], torch.get_num_threads(),
        )  # fmt: skip


_lock = threading.Lock()
_built: dict[str, Kernels] = {}
_selected: list[Kernels | None] = []  # [] = not chosen yet


def kernels_for(isa: str) -> Kernels:
    """One level's library, built on first use (OSError or SubprocessError if it cannot be)."""
    with _lock:
        if isa not in _built:
            _built[isa] = Kernels(isa, _build(isa))
        return _built[isa]


def load() -> Kernels | None:
    """This process's kernels (`select_isa`'s level), or None: turned off, or no compiler.
    A bad `TREADLE_CPU_ISA` raises ValueError."""
    if not _selected:
        kernels = None
        if envs.cpu_kernels():
            isa = select_isa()
            try:
                kernels = kernels_for(isa)
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", b"") or b""
                logger.warning(
                    "CPU kernels unavailable (%s%s); using the PyTorch paths",
                    e,
                    (": " + detail.decode(errors="replace")[-500:]) if detail else "",
                )
        with _lock:
            if not _selected:
                _selected.append(kernels)
    return _selected[0]


def for_model(device: torch.device, dtype: torch.dtype) -> Kernels | None:
    """The kernels a model on `device` in `dtype` runs on, or None (the PyTorch paths)."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    return load()


def describe(kernels: Kernels | None, device: torch.device, dtype: torch.dtype) -> str:
    """For the start-up log: which kernels a model runs on, and why not treadle's."""
    if kernels is not None:
        int8 = (
            f", {kernels.activations} activations on GGUF blocks"
            if kernels.activations in INT8_LINEAR
            else ""
        )
        return f"treadle's {kernels.isa} CPU kernels ({kernels.path.name}{int8})"
    if device.type != "cpu" or dtype != torch.float32:
        return f"PyTorch ({device.type}, {str(dtype).removeprefix('torch.')})"
    if not envs.cpu_kernels():
        return "PyTorch (TREADLE_CPU_KERNELS=0)"
    return "PyTorch (treadle's CPU kernels could not be built)"
