"""Attention over the paged KV cache, in plain PyTorch matmuls (CPU and CUDA alike).

Token layout of one step (built by the model runner, shared by every layer):

    [ decode tokens: one per decoding request | prefill chunk 0 | prefill chunk 1 | ... ]

Each layer first writes the new tokens' K/V at `slot_mapping` (slot = block * block_size +
offset), then reads each request's whole context back by its slots. Decodes are batched with
padding to the longest context; prefill chunks run one by one with a causal mask offset by the
tokens already in the cache. GQA folds the query heads of a KV head into the rows of one
matmul, so KV heads are never expanded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    start: int  # first token of the chunk in the step's token layout
    end: int
    context_slots: torch.Tensor  # [L] slots of every context token, the chunk's own included
    bias: torch.Tensor  # [Q, L] additive causal mask (0 or -inf), float32


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None  # [D, Lmax], padded with slot 0
    decode_bias: torch.Tensor | None = None  # [D, 1, 1, Lmax] additive mask, float32
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,  # [T, H, d]
    k: torch.Tensor,  # [T, Hkv, d]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, Hkv, d]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Returns [T, H * d]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)

    d = meta.num_decodes
    if d:
        assert meta.decode_slots is not None and meta.decode_bias is not None
        qd = q[:d].view(d, num_kv, group, head_dim)
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [D, Hkv, L, d]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        scores = torch.matmul(qd, kd.transpose(-1, -2)).float() * scale + meta.decode_bias
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[:d] = torch.matmul(probs, vd).reshape(d, num_heads * head_dim)

    for chunk in meta.prefills:
        n = chunk.end - chunk.start
        qp = q[chunk.start : chunk.end].view(n, num_kv, group, head_dim).permute(1, 0, 2, 3)
        qp = qp.reshape(num_kv, n * group, head_dim)
        kp = k_cache[chunk.context_slots].transpose(0, 1)  # [Hkv, L, d]
        vp = v_cache[chunk.context_slots].transpose(0, 1)
        scores = torch.matmul(qp, kp.transpose(-1, -2)).float() * scale
        scores = scores.view(num_kv, n, group, -1) + chunk.bias[None, :, None, :]
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(num_kv, n * group, -1)
        op = torch.matmul(probs, vp).view(num_kv, n, group, head_dim).permute(1, 0, 2, 3)
        out[chunk.start : chunk.end] = op.reshape(n, num_heads * head_dim)
    return out
