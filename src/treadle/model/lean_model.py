"""A GGUF Llama on treadle's C kernels with numpy and ctypes only: the lean runner's model
(`worker/lean_runner.py`; design: docs/design/torch-free-engine-core.md).

The same weights as the torch runner holds for such a model, laid out by the same functions
(`gguf_layout`: q/k rows un-permuted, q|k|v and gate|up stacked, the blocks tiled and, for int8
activations, laid out 16 outputs wide), and every step one `decode_layers_f32` call per
`MAX_ROWS` rows: decode rows, speculative verify rows and prefill rows alike, each row with its
own block-table row and context length (its K/V is written before attention reads it, so a
request's rows are causal within a call and across calls). The LM head is the product of the
final norm's rows with the output blocks (the tied embedding's where there is no `output`),
on the kernel of the activation dtype, as `linear_method.choose(lm_head=True)` has it; the
embedding rows are looked up in the same blocks.

What it takes (`unsupported` says why not, and the engine runs the torch runner instead): a
GGUF Llama or Mistral without q/k norms, biases or RoPE scaling; every linear weight in Q4_0,
Q4_1 or Q8_0; float32 activations' dtype (`--dtype auto|float32`) and KV cache; kernels built
for a level with GGUF-block products (not `portable`).

The RoPE tables follow the torch runner's float32 formula with each step correctly rounded
(`rope_tables`); PyTorch's own float32 `pow`, `cos` and `sin` are within an ulp of that, so the
two runners' tables, and logits, may differ in the last bits.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from treadle.model.arch import ModelArch
from treadle.model.gguf_file import GGUFFile, GGUFTensor
from treadle.model.gguf_layout import (
    KIND_Q4_G16,
    GGUFBlocks,
    g16_layout,
    kernel_type,
    tile_layout,
    unpermute_rope_rows,
)
from treadle.model.kernel_lib import (
    INT8_ACTIVATIONS,
    KV_F16,
    KV_F32,
    KV_I8,
    DecodeLayer,
    DecodeModel,
    g16_kinds,
)

MAX_ROWS = 256
"""Rows per `decode_layers_f32` call: its scratch is ~32 KB a row for the default model (8 MB
here), and the products of 256 rows run as fast per row as of more."""

_LINEARS = {  # DecodeLayer field -> the GGUF tensors stacked into it (after `blk.N.`)
    "qkv": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "o": ("attn_output.weight",),
    "gate_up": ("ffn_gate.weight", "ffn_up.weight"),
    "down": ("ffn_down.weight",),
}
KV_LAYOUTS = {  # --kv-cache-dtype -> (element type, bytes a row holds past head_dim, kv_type)
    "float32": (np.float32, 0, KV_F32),
    "float16": (np.float16, 0, KV_F16),
    "int8": (np.int8, 4, KV_I8),  # head_dim int8 values, then the row's float32 scale
}
_LINEAR_KERNEL = {
    "float32": "gguf_linear_f32",
    "int8": "gguf_linear_i8",
    "int8x2": "gguf_linear_i8x2",
}


def unsupported(gguf: GGUFFile, arch: ModelArch) -> str | None:
    """Why this model cannot run on `LeanModel` (None: it can)."""
    if arch.family not in ("llama", "mistral"):
        return f"the {arch.family} family"
    if arch.qk_norm or arch.qkv_bias:
        return "q/k norms or biases"
    if arch.rope_scaling:
        return "RoPE scaling"
    if arch.vision is not None:
        return "a vision tower"
    names = {t.name: t for t in gguf.tensors}
    for name, t in names.items():
        if name.startswith("blk.") and len(t.shape) == 2 and not kernel_type(t.kind):
            return f"{name} in {t.kind} (the lean runner reads Q4_0, Q4_1 and Q8_0)"
        if name.endswith(".bias"):
            return f"a bias ({name})"
    if "output.weight" in names and not kernel_type(names["output.weight"].kind):
        return f"an output layer in {names['output.weight'].kind}"
    embed = names.get("token_embd.weight")
    if embed is None or ("output.weight" not in names and not kernel_type(embed.kind)):
        return "a tied embedding that is not in Q4_0, Q4_1 or Q8_0"
    return None


@dataclass
class _Weight:
    """A linear weight laid out for the kernels: its array and the kernel's block kind."""

    array: np.ndarray
    kind: int
    out_features: int


class LeanModel:
    def __init__(
        self,
        gguf: GGUFFile,
        arch: ModelArch,
        isa: str,
        lib: ctypes.CDLL,
        activations: str,
        max_positions: int,
    ) -> None:
        """`lib`: the kernels built for ISA level `isa`; `activations`:
        `--cpu-activation-dtype` (float32, int8, int8x2)."""
        self.arch, self.isa, self.lib = arch, isa, lib
        self.activations = activations
        self._linear = getattr(lib, _LINEAR_KERNEL[activations])
        self._g16 = activations != "float32"
        self._g16_kinds = g16_kinds(lib)
        tensors = {t.name: t for t in gguf.tensors}
        release = gguf.release_pages
        self.layers = (DecodeLayer * arch.num_layers)()
        self._keep: list[np.ndarray] = []  # every array a pointer in the structs points into
        heads = {"attn_q.weight": arch.num_heads, "attn_k.weight": arch.num_kv_heads}
        for i, spec in enumerate(self.layers):
            b = f"blk.{i}."
            for field, names in _LINEARS.items():
                w = self._weight([(tensors[b + n], heads.get(n, 0)) for n in names], release)
                setattr(spec, field, w.array.ctypes.data)
                setattr(spec, f"{field}_kind", w.kind)
                self._keep.append(w.array)
            for field, name in (
                ("input_norm", "attn_norm.weight"),
                ("post_norm", "ffn_norm.weight"),
            ):
                norm = _f32(tensors[b + name])
                setattr(spec, field, norm.ctypes.data)
                self._keep.append(norm)
        self.final_norm = _f32(tensors["output_norm.weight"])
        self.vocab_size = tensors["token_embd.weight"].shape[0]
        self.lm_head = self._weight(
            [(tensors.get("output.weight", tensors["token_embd.weight"]), 0)], release
        )
        if "output.weight" in tensors:  # untied: the embedding's own rows
            embed = tensors["token_embd.weight"]
            if kernel_type(embed.kind):
                self.embed = self._weight([(embed, 0)], release)
            else:
                self.embed = _Weight(_f32(embed), -1, self.vocab_size)
        else:
            self.embed = self.lm_head
        gguf.release_pages()
        self.cos, self.sin = rope_tables(arch.head_dim, max_positions, arch.rope_theta)
        self.spec = DecodeModel(
            hidden=arch.hidden_size,
            heads=arch.num_heads,
            kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            intermediate=arch.intermediate_size,
            num_layers=arch.num_layers,
            eps=arch.rms_norm_eps,
            scale=arch.head_dim**-0.5,
            final_norm=self.final_norm.ctypes.data,
            int8_activations=INT8_ACTIVATIONS[activations],
            kv_type=KV_F32,
            lora_slot=None,
            lora_wtype=0,
        )
        self.kv_caches: list[tuple[np.ndarray, np.ndarray]] = []

    def _weight(self, parts: list[tuple[GGUFTensor, int]], release: Callable[[], None]) -> _Weight:
        """The parts' rows stacked and laid out as `QuantizedWeight.build` (+ `to_g16` for
        int8 activations where this level runs it) lays them out for the torch runner."""
        blocks = [  # (`release`: the file's pages unmapped as their rows are copied out)
            GGUFBlocks(
                t.kind,
                unpermute_rope_rows(t.data, heads) if heads else t.data,
                release,
            )
            for t, heads in parts
        ]
        rows = sum(t.shape[0] for t, _ in parts)
        laid = tile_layout(list(blocks), rows)
        assert laid is not None, "checked by `unsupported`"
        tiles, kind, _ = laid
        if self._g16 and self._g16_kinds >> kind & 1:
            return _Weight(g16_layout(tiles, kind, in_place=True), kind + KIND_Q4_G16, rows)
        return _Weight(tiles, kind, rows)

    @property
    def weight_bytes(self) -> int:
        arrays = [*self._keep, self.final_norm, self.lm_head.array, self.cos, self.sin]
        if self.embed is not self.lm_head:
            arrays.append(self.embed.array)
        return sum(a.nbytes for a in arrays)

    def kv_bytes_per_block(self, block_size: int, kv_dtype: str) -> int:
        a = self.arch
        dtype, extra, _ = KV_LAYOUTS[kv_dtype]
        row = a.head_dim * np.dtype(dtype).itemsize + extra
        return 2 * a.num_layers * a.num_kv_heads * block_size * row

    def initialize_cache(self, num_blocks: int, block_size: int, kv_dtype: str) -> None:
        """Per layer a K and a V cache `[kv heads, num_blocks, block_size, row]` of
        `KV_LAYOUTS[kv_dtype]` (an int8 row: head_dim values and a float32 scale, as the torch
        runner's `attention.kv_row_shape`), in fresh anonymous memory (resident as written)."""
        a = self.arch
        dtype, extra, kv_type = KV_LAYOUTS[kv_dtype]
        shape = (a.num_kv_heads, num_blocks, block_size, a.head_dim + extra)
        self.kv_caches = [(_zeros(shape, dtype), _zeros(shape, dtype)) for _ in range(a.num_layers)]
        for spec, (k, v) in zip(self.layers, self.kv_caches, strict=True):
            spec.k_cache, spec.v_cache = k.ctypes.data, v.ctypes.data
        self.spec.num_blocks, self.spec.block_size = num_blocks, block_size
        self.spec.kv_type = kv_type

    def embeddings(self, ids: np.ndarray) -> np.ndarray:
        """float32 [len(ids), hidden]: the embedding's rows of `ids` (int64)."""
        e = self.embed
        if e.kind < 0:
            return e.array[ids]
        out = np.empty((len(ids), self.arch.hidden_size), np.float32)
        self.lib.gguf_dequantize_rows_f32(
            e.array.ctypes.data, e.kind, e.out_features, self.arch.hidden_size,
            ids.ctypes.data, len(ids), out.ctypes.data,
        )  # fmt: skip
        return out

    def forward(
        self,
        ids: np.ndarray,  # int64 [M]
        positions: np.ndarray,  # int64 [M]
        slots: np.ndarray,  # int64 [M]: where each row's K/V goes
        tables: np.ndarray,  # int64 [M or 1, max blocks]: each row's block table
        lens: np.ndarray,  # int32 [M]: each row's context length (its position + 1)
        threads: int,
    ) -> np.ndarray:
        """The final norm's output for the M rows, float32 [M, hidden]; their K/V written."""
        m = len(ids)
        out = np.empty((m, self.arch.hidden_size), np.float32)
        stride = tables.shape[1] if tables.shape[0] > 1 else 0
        for lo in range(0, m, MAX_ROWS):
            hi = min(m, lo + MAX_ROWS)
            emb = self.embeddings(ids[lo:hi])
            pos = positions[lo:hi]
            cos, sin = self.cos[pos], self.sin[pos]
            table = tables[lo:hi] if stride else tables
            part = lens[lo:hi]
            self.lib.decode_layers_f32(
                ctypes.addressof(self.spec), ctypes.addressof(self.layers), emb.ctypes.data,
                hi - lo, cos.ctypes.data, sin.ctypes.data, slots[lo:hi].ctypes.data,
                table.ctypes.data, stride, part.ctypes.data, int(part.max()),
                out[lo:hi].ctypes.data, threads,
            )  # fmt: skip
        return out

    def logits(self, hidden: np.ndarray, threads: int) -> np.ndarray:
        """float32 [rows, vocab]: the LM head's product with `hidden` [rows, hidden]."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        m, k = hidden.shape
        w = self.lm_head
        out = np.empty((m, w.out_features), np.float32)
        self._linear(
            hidden.ctypes.data, k, m, k, w.array.ctypes.data, w.kind, w.out_features,
            out.ctypes.data, w.out_features, threads,
        )  # fmt: skip
        return out


def rope_tables(head_dim: int, max_positions: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """Neox RoPE's cos and sin, float32 [max_positions, head_dim], by `layers.RotaryEmbedding`'s
    float32 formula (angles: float32 position x float32 inverse frequency), each float32 step
    correctly rounded from float64 math (PyTorch's `pow`, `cos`, `sin`: within an ulp of it)."""
    exponent = (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)).astype(
        np.float64
    )
    inv_freq = np.float32(1.0) / (np.float64(base) ** exponent).astype(np.float32)
    freqs = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1).astype(np.float64)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _zeros(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Zeros in their own anonymous mapping, committed page by page as they are
    written (as the torch runner's KV cache: `model_runner.zeros`). Not `np.zeros`: numpy
    asks for transparent huge pages for large arrays, and each 2 MB page a prefill first
    writes is then zeroed, and often compacted for, in the step: a 512-token prefill of the
    default model took 320 ms against 265 with a 1 GiB cache."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(memory, dtype=dtype).reshape(shape)  # (keeps `memory`)


def _f32(t: GGUFTensor) -> np.ndarray:
    return np.ascontiguousarray(t.dequantize(), dtype=np.float32)
