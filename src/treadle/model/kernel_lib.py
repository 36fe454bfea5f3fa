"""treadle's C kernels below PyTorch: the ISA level a process runs, the compiled library's
C signatures, and the structs `decode_layers_f32` reads. Nothing here imports torch, so a
process that runs the kernels on numpy arrays (the lean runner's `lean_model.py`,
`docs/design/torch-free-engine-core.md`) shares them with `cpu_kernels.py`, which wraps
the same library for PyTorch tensors.

ISA levels, best first: `avx512vnni` (x86-64-v4 and AVX512-VNNI, for the int8 dot products),
`avx512` (x86-64-v4), `avx2vnni` (x86-64-v3 and AVX-VNNI, the 256-bit integer dot product of
Intel's cores from Alder Lake and Sierra Forest on and AMD's from Zen 5), `avx2` (x86-64-v3:
AVX2, FMA, F16C), `portable` (no flags: any CPU the compiler targets). A CPU runs the levels
whose flags it has (an AVX-512 CPU may lack AVX-VNNI). The level is chosen once per process
from the CPU's flags (`detect_isa`), or forced with `TREADLE_CPU_ISA` (a level this CPU can
run: a lower one lets the AVX2 path be tested and measured on an AVX-512 machine).
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

from treadle import envs

ISA_LEVELS = ("avx512vnni", "avx512", "avx2vnni", "avx2", "portable")  # best first
_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c"}
# The CPU flags (as /proc/cpuinfo names them) each x86 level's code needs.
_LEVEL_CPU_FLAGS = {
    "avx512vnni": _AVX512 | {"avx512_vnni"},
    "avx512": _AVX512,
    "avx2vnni": {"avx2", "fma", "f16c", "avx_vnni"},
    "avx2": {"avx2", "fma", "f16c"},
}


def _cpuinfo(field: str) -> str:
    """The first CPU's `field` line of /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith(field):
            return line.partition(":")[2].strip()
    return ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return set(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (`GenuineIntel`, `AuthenticAMD`; "" where there is none)."""
    return _cpuinfo("vendor_id")


def available_isas() -> list[str]:
    """The levels this CPU runs, best first (`portable` always)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["portable"]
    flags = cpu_flags()
    if not flags:  # no /proc/cpuinfo (e.g. macOS): PyTorch's own cpuid reading
        import torch  # (only there: Linux reads the flags above)

        capability = torch.backends.cpu.get_cpu_capability().lower()
        best = {"avx512": "avx512", "avx2": "avx2"}.get(capability, "portable")
        levels = ISA_LEVELS[ISA_LEVELS.index(best) :]
        return [level for level in levels if level != "avx2vnni"]
    return [
        level for level in ISA_LEVELS if level == "portable" or _LEVEL_CPU_FLAGS[level] <= flags
    ]


def detect_isa() -> str:
    """The best level this CPU runs."""
    return available_isas()[0]


def select_isa() -> str:
    """`TREADLE_CPU_ISA` when set, else the best level this CPU runs."""
    best = detect_isa()
    forced = envs.cpu_isa()
    if forced is None:
        return best
    if forced not in ISA_LEVELS:
        raise ValueError(f"TREADLE_CPU_ISA={forced!r}: choose one of {', '.join(ISA_LEVELS)}")
    if forced not in available_isas():
        raise ValueError(
            f"TREADLE_CPU_ISA={forced}, but this CPU runs only {', '.join(available_isas())}"
        )
    return forced


i64, ptr, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
i32 = ctypes.c_int32
# The KV cache's element types as csrc/common.h numbers them (KV_F32 ... KV_I8); an int8
# cache's rows are head_dim int8 values and the row's float32 scale (`attention.py`).
KV_F32, KV_F16, KV_BF16, KV_I8 = 0, 1, 2, 3

SIGNATURES = {
    "paged_decode_attention_f32": [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64]
    + [i64] * 6
    + [f32, i64, c_int, c_int],
    "gguf_linear_f32": [ptr, i64, i64, i64, ptr, c_int, i64, ptr, i64, c_int],
    "gguf_dequantize_f32": [ptr, c_int, i64, i64, ptr, c_int],
    "gguf_dequantize_rows_f32": [ptr, c_int, i64, i64, ptr, i64, ptr],
    "gguf_linear_i8": [ptr, i64, i64, i64, ptr, c_int, i64, ptr, i64, c_int],
    "gguf_linear_i8x2": [ptr, i64, i64, i64, ptr, c_int, i64, ptr, i64, c_int],
    "rms_norm_f32": [ptr, i64, i64, i64, ptr, f32, ptr, i64, c_int],
    "add_rms_norm_f32": [ptr, ptr, i64, i64, ptr, f32, ptr, c_int],
    "rope_f32": [ptr, i64, i64, i64, i64, ptr, ptr, c_int],
    "silu_and_mul_f32": [ptr, i64, i64, ptr, c_int],
    "lora_apply_f32": [ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, ptr, i64, c_int],
    "write_kv_f32": [ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, c_int],
    "decode_layers_f32": [ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, c_int],
    "apply_token_bitmask_f32": [ptr, i64, ptr, i64, ptr, i64, i64, c_int],
}


def open_library(isa: str, path: Path) -> ctypes.CDLL:
    """The library at `path`, checked to be built for `isa` (OSError if not), each kernel
    with its C signature."""
    lib = ctypes.CDLL(str(path))
    lib.treadle_kernel_isa.restype = ctypes.c_char_p
    built_for = lib.treadle_kernel_isa().decode()
    if built_for != isa:  # the compiler ignored the level's flags
        raise OSError(f"{path.name} was built for {built_for!r}, not {isa!r}")
    lib.gguf_linear_i8_max_rows.restype = ctypes.c_int
    if hasattr(lib, "gguf_g16_kinds"):  # (not in a library built from older sources)
        lib.gguf_g16_kinds.restype = ctypes.c_int
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def g16_kinds(lib: ctypes.CDLL) -> int:
    """The block kinds (bit 1 << kind) this library runs laid out 16 outputs wide, with int8
    activations at every row count (`QuantizedWeight.to_g16`, `csrc/int8.h`); none in a
    library built from older sources (benchmarks/linear_crossover.py --variant)."""
    return int(lib.gguf_g16_kinds()) if hasattr(lib, "gguf_g16_kinds") else 0


# decode_layers_f32's arguments (csrc/cpu_kernels.c; `model/fused_decode.py` fills them).


class DecodeLayer(ctypes.Structure):  # decode_layer: one layer's weights, KV cache, adapters
    _fields_ = [
        ("input_norm", ptr), ("post_norm", ptr), ("qkv", ptr), ("o", ptr), ("gate_up", ptr),
        ("down", ptr), ("qkv_bias", ptr), ("k_cache", ptr), ("v_cache", ptr), ("qkv_kind", i32),
        ("o_kind", i32), ("gate_up_kind", i32), ("down_kind", i32),
        ("qkv_lora_a", ptr), ("qkv_lora_b", ptr), ("o_lora_a", ptr), ("o_lora_b", ptr),
        ("gate_up_lora_a", ptr), ("gate_up_lora_b", ptr), ("down_lora_a", ptr),
        ("down_lora_b", ptr), ("qkv_lora_ends", ptr), ("o_lora_ends", ptr),
        ("gate_up_lora_ends", ptr), ("down_lora_ends", ptr), ("qkv_lora_as", ptr),
        ("o_lora_as", ptr), ("gate_up_lora_as", ptr), ("down_lora_as", ptr), ("qkv_lora_bs", ptr),
        ("o_lora_bs", ptr), ("gate_up_lora_bs", ptr), ("down_lora_bs", ptr), ("qkv_lora_rank", i64),
        ("o_lora_rank", i64), ("gate_up_lora_rank", i64), ("down_lora_rank", i64),
        ("qkv_lora_shards", i64), ("o_lora_shards", i64), ("gate_up_lora_shards", i64),
        ("down_lora_shards", i64),
    ]  # fmt: skip


class DecodeModel(ctypes.Structure):  # decode_model: the shapes, the final norm, the modes
    _fields_ = [
        ("hidden", i64), ("heads", i64), ("kv_heads", i64), ("head_dim", i64),
        ("intermediate", i64), ("num_layers", i64), ("num_blocks", i64),
        ("block_size", i64), ("eps", f32), ("scale", f32), ("final_norm", ptr),
        ("int8_activations", i32), ("kv_type", i32), ("lora_slot", ptr), ("lora_wtype", i32),
    ]  # fmt: skip


# `int8_activations` of each activation dtype (`--cpu-activation-dtype`): the linear layers
# on gguf_linear_f32 (0), gguf_linear_i8 (1) or gguf_linear_i8x2 (2).
INT8_ACTIVATIONS = {"float32": 0, "int8": 1, "int8x2": 2}
