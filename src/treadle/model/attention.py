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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treadle.model.cpu_kernels import Kernels


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
        k_cache.view(num_kv, -1, head_dim)[:, meta.slot_mapping] = k.transpose(0, 1)
        v_cache.view(num_kv, -1, head_dim)[:, meta.slot_mapping] = v.transpose(0, 1)
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        d = meta.num_decodes
        if d:
            assert meta.decode_block_table is not None and meta.decode_bias is not None
            qd = q[:d].view(d, num_kv, group, head_dim).transpose(0, 1)  # [Hkv, D, g, d]
            blocks = meta.decode_block_table.flatten()
            if meta.decode_k is None or meta.decode_v is None:
                shape = (num_kv, blocks.numel(), k_cache.shape[2], head_dim)
                meta.decode_k = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
                meta.decode_v = torch.empty(shape, dtype=v_cache.dtype, device=v_cache.device)
            torch.index_select(k_cache, 1, blocks, out=meta.decode_k)
            torch.index_select(v_cache, 1, blocks, out=meta.decode_v)
            kd = meta.decode_k.view(num_kv, d, -1, head_dim)  # [Hkv, D, L, d]
            vd = meta.decode_v.view(num_kv, d, -1, head_dim)
            scores = torch.matmul(qd, kd.transpose(-1, -2)).float() * scale
            scores += meta.decode_bias[None, :, None, :]
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            out[:d] = torch.matmul(probs, vd).transpose(0, 1).reshape(d, num_heads * head_dim)
        for chunk in meta.prefills:
            assert chunk.bias is not None
            n = chunk.end - chunk.start
            qp = q[chunk.start : chunk.end].view(n, num_kv, group, head_dim).permute(1, 0, 2, 3)
            qp = qp.reshape(num_kv, n * group, head_dim)
            kp = k_cache[:, chunk.block_ids].view(num_kv, -1, head_dim)  # [Hkv, L, d]
            vp = v_cache[:, chunk.block_ids].view(num_kv, -1, head_dim)
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
