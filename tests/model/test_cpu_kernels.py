"""The C attention kernel (`CpuKernelAttention`) against the PyTorch backend, at every ISA level
this CPU runs (`portable` always), on random paged caches: GQA groups of 1, 3, 4 and 8, head
sizes 64 (the hand-tiled paths) and 32, context lengths that end inside a block and on either
side of the 8-token groups of the AVX2 path, scattered block tables, strided query rows."""

from __future__ import annotations

import pytest
import torch

from treadle.model import cpu_kernels
from treadle.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    CpuKernelAttention,
    TorchAttention,
)

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None,
    reason="no C compiler here (or TREADLE_CPU_KERNELS=0): the kernel cannot be built",
)


@pytest.fixture(params=cpu_kernels.available_isas())
def kernel_backend(request: pytest.FixtureRequest) -> CpuKernelAttention:
    return CpuKernelAttention(cpu_kernels.kernels_for(request.param))


def run(heads: int, kv_heads: int, lengths: list[int], backend: AttentionBackend) -> torch.Tensor:
    torch.manual_seed(0)
    head_dim, block_size, num_blocks = 64, 16, 512
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
        decode_lens=lens.to(torch.int32),
        decode_max_len=max(lengths),
    )
    return backend.forward(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 2), (8, 1)])
def test_the_kernel_matches_the_pytorch_path(
    heads: int, kv_heads: int, kernel_backend: CpuKernelAttention
) -> None:
    lengths = [1, 15, 16, 17, 100, 333, 40, 2, 7, 8, 9, 23, 24, 25]
    expected = run(heads, kv_heads, lengths, TorchAttention())
    got = run(heads, kv_heads, lengths, kernel_backend)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 64), (4, 2, 32)])
def test_prefill_chunks_on_the_kernel_match_the_pytorch_path(
    heads: int, kv_heads: int, head_dim: int, kernel_backend: CpuKernelAttention
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
        chunks.append(PrefillChunk(start, start + n, blocks, (pos + 1).to(torch.int32), bias))
        slots += [int(blocks[p // block_size]) * block_size + p % block_size for p in pos]
        start += n
    q = torch.randn(start, heads, head_dim)
    k, v = torch.randn(start, kv_heads, head_dim), torch.randn(start, kv_heads, head_dim)

    def attend(backend: AttentionBackend) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), prefills=chunks)
        return backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, head_dim**-0.5)

    torch.testing.assert_close(
        attend(kernel_backend), attend(TorchAttention()), rtol=1e-5, atol=1e-5
    )
