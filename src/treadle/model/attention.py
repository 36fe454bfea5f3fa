"""Attention over the paged KV cache: two backends, one chosen per model at load time
(`select_backend`).

KV cache layout, per layer and for K and V alike: `[num_kv_heads, num_blocks, block_size,
head_dim]`. Indexing dim 1 with a block table gives `[Hkv, ..., blocks, block_size, d]`
already contiguous, so a request's context is one gather of whole blocks and a free view,
never a per-token copy.

Token layout of one step (built by the model runner, shared by every layer):

    [ decode tokens: one per decoding request | prefill chunk 0 | prefill chunk 1 | ... ]

Each layer first writes the new tokens' K/V at `slot_mapping` (slot = block * block_size +
offset), then reads each request's context back by its blocks.

- `CpuKernelAttention` (float32 on the CPU, treadle's C kernels): one task per (request, KV
  head) walks the block table and reads every K/V row once, up to the request's own length;
  each query token of a prefill chunk is a decode of its own length (position + 1) over the
  chunk's blocks. It reads lengths, never masks (`needs_mask` False: the model runner builds
  none).
- `TorchAttention` (CUDA, bfloat16, no compiler): decodes batched, padded to the longest
  block table; prefill chunks one by one with a causal mask offset by the tokens already in
  the cache. Positions past a request's length are masked with -inf. GQA folds the query heads
  of one KV head into the rows of one matmul, so KV heads are never expanded.

The cache's element type (`--kv-cache-dtype`, `resolve_kv_cache_dtype`) may differ from the
model's: float32, float16, bfloat16, or int8 with one float32 scale per (token, head) row, kept
in the row's last 4 bytes (`quantize_int8`: rows of head_dim + 4 int8 values, so a block is
still one slice of dim 1 and moves as one piece). Both backends round or quantize on write and
widen on read: the C kernels in registers, PyTorch on the gathered blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treadle.model.cpu_kernels import Kernels

_KV_STORAGE = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
INT8_SCALE_BYTES = 4  # an int8 row's float32 scale, after its head_dim values


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> str:
    """The cache's element type for `--kv-cache-dtype name`: `auto` is the model's dtype."""
    if name == "auto":
        return str(model_dtype).removeprefix("torch.")
    if name not in _KV_STORAGE:
        raise ValueError(f"kv cache dtype {name!r}: choose one of auto, {', '.join(_KV_STORAGE)}")
    return name


def kv_row_shape(kv_dtype: str, head_dim: int) -> tuple[torch.dtype, int]:
    """(the storage dtype, elements per cache row) of one token's K or V of one head."""
    if kv_dtype == "int8":
        return torch.int8, head_dim + INT8_SCALE_BYTES
    return _KV_STORAGE[kv_dtype], head_dim


def kv_row_bytes(kv_dtype: str, head_dim: int) -> int:
    dtype, width = kv_row_shape(kv_dtype, head_dim)
    return dtype.itemsize * width


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., d] -> [..., d + 4] int8: q = rint(x * (127 / max|x|)) and the float32 scale
    max|x| / 127 as its 4 bytes (x = q * scale). The C kernels' write (`kv_store_row_c`) makes
    the same bits: the same float32 operations, rint and torch.round both half to even."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).to(torch.int8)
    return torch.cat([q, (amax / 127.0).view(torch.int8)], dim=-1)


def dequantize_int8(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`quantize_int8`'s rows back to [..., d] in `dtype`."""
    d = packed.shape[-1] - INT8_SCALE_BYTES
    scale = packed[..., d:].contiguous().view(torch.float32)
    return (packed[..., :d].float() * scale).to(dtype)


def to_cache_rows(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rows [..., d] as `cache` stores them (rounded, or quantized for an int8 cache)."""
    return quantize_int8(x) if cache.dtype == torch.int8 else x.to(cache.dtype)


def from_cache_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows back to [..., d] in `dtype`."""
    return dequantize_int8(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)


@dataclass
class PrefillChunk:
    start: int  # first token of the chunk in the step's token layout
    end: int
    block_ids: torch.Tensor  # [nb] blocks holding the context, the chunk's own tokens included
    lens: torch.Tensor  # [Q] int32 tokens each query attends to (its position + 1)
    bias: torch.Tensor | None = None  # [Q, nb * block_size] causal mask (0 or -inf), float32


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int = 0
    decode_block_table: torch.Tensor | None = None  # [D, nb], padded with block 0
    decode_bias: torch.Tensor | None = None  # [D, nb * block_size] additive mask, float32
    decode_lens: torch.Tensor | None = None  # [D] int32 context tokens, the new one included
    decode_max_len: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Gather buffers for the decode context, made by the first layer and reused by the
    # others: a fresh multi-MB tensor per layer costs more in page faults than the copy.
    decode_k: torch.Tensor | None = None
    decode_v: torch.Tensor | None = None


class AttentionBackend:
    needs_mask = True  # whether the model runner must build the additive -inf masks

    def forward(
        self,
        q: torch.Tensor,  # [T, H, d]
        k: torch.Tensor,  # [T, Hkv, d]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, d]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Writes the new K/V into the cache; returns [T, H * d]."""
        raise NotImplementedError


class CpuKernelAttention(AttentionBackend):
    needs_mask = False

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        self.kernels.write_kv(k, v, meta.slot_mapping, k_cache, v_cache)
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype)
        d = meta.num_decodes
        if d:
            assert meta.decode_block_table is not None and meta.decode_lens is not None
            self.kernels.paged_decode_attention(
                q[:d], k_cache, v_cache, meta.decode_block_table, meta.decode_lens,
                meta.decode_max_len, out[:d], scale,
            )  # fmt: skip
        for chunk in meta.prefills:  # each query token as a decode of its own length
            n = chunk.end - chunk.start
            self.kernels.paged_decode_attention(
                q[chunk.start : chunk.end], k_cache, v_cache,
                chunk.block_ids.unsqueeze(0).expand(n, -1), chunk.lens, int(chunk.lens[-1]),
                out[chunk.start : chunk.end], scale,
            )  # fmt: skip
        return out


class TorchAttention(AttentionBackend):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv = k.shape[1]
        group = num_heads // num_kv
        width = k_cache.shape[3]  # head_dim, or head_dim + 4 in an int8 cache
        new_k, new_v = to_cache_rows(k, k_cache), to_cache_rows(v, v_cache)
        k_cache.view(num_kv, -1, width)[:, meta.slot_mapping] = new_k.transpose(0, 1)
        v_cache.view(num_kv, -1, width)[:, meta.slot_mapping] = new_v.transpose(0, 1)
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        d = meta.num_decodes
        if d:
            assert meta.decode_block_table is not None and meta.decode_bias is not None
            qd = q[:d].view(d, num_kv, group, head_dim).transpose(0, 1)  # [Hkv, D, g, d]
            blocks = meta.decode_block_table.flatten()
            if meta.decode_k is None or meta.decode_v is None:
                shape = (num_kv, blocks.numel(), k_cache.shape[2], width)
                meta.decode_k = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
                meta.decode_v = torch.empty(shape, dtype=v_cache.dtype, device=v_cache.device)
            torch.index_select(k_cache, 1, blocks, out=meta.decode_k)
            torch.index_select(v_cache, 1, blocks, out=meta.decode_v)
            kd = from_cache_rows(meta.decode_k, q.dtype).view(num_kv, d, -1, head_dim)
            vd = from_cache_rows(meta.decode_v, q.dtype).view(num_kv, d, -1, head_dim)
            scores = torch.matmul(qd, kd.transpose(-1, -2)).float() * scale
            scores += meta.decode_bias[None, :, None, :]
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            out[:d] = torch.matmul(probs, vd).transpose(0, 1).reshape(d, num_heads * head_dim)
        for chunk in meta.prefills:
            assert chunk.bias is not None
            n = chunk.end - chunk.start
            qp = q[chunk.start : chunk.end].view(n, num_kv, group, head_dim).permute(1, 0, 2, 3)
            qp = qp.reshape(num_kv, n * group, head_dim)
            kp = from_cache_rows(k_cache[:, chunk.block_ids], q.dtype).view(num_kv, -1, head_dim)
            vp = from_cache_rows(v_cache[:, chunk.block_ids], q.dtype).view(num_kv, -1, head_dim)
            scores = torch.matmul(qp, kp.transpose(-1, -2)).float() * scale
            scores = scores.view(num_kv, n, group, -1) + chunk.bias[None, :, None, :]
            probs = torch.softmax(scores, dim=-1).to(q.dtype).view(num_kv, n * group, -1)
            op = torch.matmul(probs, vp).view(num_kv, n, group, head_dim).permute(1, 0, 2, 3)
            out[chunk.start : chunk.end] = op.reshape(n, num_heads * head_dim)
        return out


def select_backend(kernels: Kernels | None) -> AttentionBackend:
    """The C kernels where the model runs on them (the generic loop takes any head size; 64
    has a hand-tiled path at AVX2 and AVX-512), else PyTorch."""
    return CpuKernelAttention(kernels) if kernels is not None else TorchAttention()
