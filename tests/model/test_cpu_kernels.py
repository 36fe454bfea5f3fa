"""The C decode-attention kernel against the PyTorch path of `paged_attention`, on random
paged caches: GQA groups of 1, 3 and 4, context lengths that end inside a block, scattered
block tables, strided query rows."""

from __future__ import annotations

import pytest
import torch

from treadle.model import cpu_kernels
from treadle.model.attention import AttentionMetadata, paged_attention

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None,
    reason="no C compiler here (or TREADLE_CPU_KERNELS=0): the kernel cannot be built",
)


def run(heads: int, kv_heads: int, lengths: list[int], use_kernel: bool) -> torch.Tensor:
    torch.manual_seed(0)
    head_dim, block_size, num_blocks = 64, 16, 256
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim)
    v_cache = torch.randn_like(k_cache)
    d = len(lengths)
    max_blocks = -(-max(lengths) // block_size)
    table = torch.randperm(num_blocks)[: d * max_blocks].view(d, max_blocks)
    # The new token's K/V goes to the last slot of each request's context.
    slots = [
        int(table[r, (n - 1) // block_size]) * block_size + (n - 1) % block_size
        for r, n in enumerate(lengths)
    ]
    qkv = torch.randn(d, (heads + 2 * kv_heads) * head_dim)  # q rows strided, as in the model
    q = qkv[:, : heads * head_dim].view(d, heads, head_dim)
    k = torch.randn(d, kv_heads, head_dim)
    v = torch.randn(d, kv_heads, head_dim)
    ctx = torch.arange(max_blocks * block_size)
    lens = torch.tensor(lengths)
    bias = torch.zeros(d, max_blocks * block_size).masked_fill_(ctx >= lens[:, None], float("-inf"))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=d,
        decode_block_table=table,
        decode_bias=bias,
        decode_lens=lens.to(torch.int32) if use_kernel else None,
        decode_max_len=max(lengths),
    )
    return paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 2), (8, 1)])
def test_the_kernel_matches_the_pytorch_path(heads: int, kv_heads: int) -> None:
    lengths = [1, 15, 16, 17, 100, 333, 40, 2]
    expected = run(heads, kv_heads, lengths, use_kernel=False)
    got = run(heads, kv_heads, lengths, use_kernel=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 64), (4, 2, 32)])
def test_prefill_chunks_on_the_kernel_match_the_pytorch_path(
    heads: int, kv_heads: int, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prefill chunks, one after 40 cached tokens: each query token attends causally to
    its own prefix (the kernel takes it as a decode of length position + 1)."""
    from treadle.model.attention import PrefillChunk

    torch.manual_seed(1)
    block_size, num_blocks = 16, 64
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim)
    v_cache = torch.randn_like(k_cache)
    chunks, slots, start = [], [], 0
    for cached, n in [(40, 37), (0, 21)]:
        total = cached + n
        blocks = torch.randperm(num_blocks)[: -(-total // block_size)]
        pos = torch.arange(cached, total)
        ctx = torch.arange(len(blocks) * block_size)
        bias = torch.zeros(n, len(ctx)).masked_fill_(ctx[None, :] > pos[:, None], float("-inf"))
        chunks.append(PrefillChunk(start, start + n, blocks, bias, (pos + 1).to(torch.int32)))
        slots += [int(blocks[p // block_size]) * block_size + p % block_size for p in pos]
        start += n
    q = torch.randn(start, heads, head_dim)
    k, v = torch.randn(start, kv_heads, head_dim), torch.randn(start, kv_heads, head_dim)

    def attend() -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), prefills=chunks)
        return paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, head_dim**-0.5)

    got = attend()
    monkeypatch.setattr(cpu_kernels, "usable", lambda q, k_cache: False)
    torch.testing.assert_close(got, attend(), rtol=1e-5, atol=1e-5)
