"""The C attention kernel (`CpuKernelAttention`) against the PyTorch backend, at every ISA level
this CPU runs (`portable` always), on random paged caches: GQA groups of 1, 3, 4 and 8, head
sizes 64 (the hand-tiled paths) and 32, context lengths that end inside a block and on either
side of the 8-token groups of the AVX2 path, scattered block tables, strided query rows."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treadle.model import cpu_kernels, kernel_lib
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


def run(
    heads: int, kv_heads: int, lengths: list[int], backend: AttentionBackend, head_dim: int = 64
) -> torch.Tensor:
    torch.manual_seed(0)
    block_size, num_blocks = 16, 1024
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
    # (past 256 tokens the hand-tiled path splits a context in parts of 256, then combines them)
    lengths = [1, 15, 16, 17, 100, 333, 40, 2, 7, 8, 9, 23, 24, 25, 256, 257, 512, 700]
    expected = run(heads, kv_heads, lengths, TorchAttention())
    got = run(heads, kv_heads, lengths, kernel_backend)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_generic_loop_splits_long_contexts_too(kernel_backend: CpuKernelAttention) -> None:
    """Head size 128 (the generic loop at every level), one long request and a few."""
    for lengths in ([700], [300, 5, 513]):
        expected = run(4, 2, lengths, TorchAttention(), head_dim=128)
        got = run(4, 2, lengths, kernel_backend, head_dim=128)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (8, 1, 64), (4, 2, 128)])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(
    kernel_backend: CpuKernelAttention, heads: int, kv_heads: int, d: int
) -> None:
    """A long context is split by its own length only, whether its parts run as tasks of their
    own (few rows: one request's KV heads on 2 threads) or in turn in one task (many): alone
    or beside 7 others, a row's output has the same bits (the hand-tiled path, and the generic
    loop: 8 query heads a KV head, head size 128)."""
    torch.manual_seed(2)
    bs, num_blocks = 16, 512
    k_cache = torch.randn(kv_heads, num_blocks, bs, d)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([700, 40, 257, 1, 513, 256, 300, 90], dtype=torch.int32)
    table = torch.randperm(num_blocks)[: 8 * 44].view(8, 44)
    q = torch.randn(8, heads, d)
    together = torch.empty(8, heads * d)
    kernels = kernel_backend.kernels
    kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, 700, together, 0.125)
    for r in range(8):
        alone = torch.empty(1, heads * d)
        n = int(lens[r])
        kernels.paged_decode_attention(
            q[r : r + 1], k_cache, v_cache, table[r : r + 1], lens[r : r + 1], n, alone, 0.125
        )
        assert torch.equal(alone[0], together[r]), (r, n)


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (8, 1, 64), (4, 2, 128)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_one_requests_rows_read_its_kv_once_with_each_rows_bits(
    kernel_backend: CpuKernelAttention, heads: int, kv_heads: int, d: int, kv_dtype: torch.dtype
) -> None:
    """The rows of one request that a speculative step verifies (its block table repeated,
    lengths n, n + 1, ...) and a prefill chunk's (one table, row stride 0) share a task that
    reads their KV once: each row still has the bits it has alone, on either side of the
    parts of 256 tokens, beside another request's rows and cut in pieces for the threads."""
    torch.manual_seed(3)
    bs, num_blocks = 16, 256
    k_cache = torch.randn(kv_heads, num_blocks, bs, d).to(kv_dtype)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(kv_dtype)
    kernels = kernel_backend.kernels
    perm = torch.randperm(num_blocks)
    ours, other = perm[:40], perm[40:80]
    lens = [250 + i for i in range(9)] + [30, 31, 32] + [505 + i for i in range(5)]
    table = torch.stack([ours] * 9 + [other] * 3 + [ours] * 5)
    q = torch.randn(len(lens), heads, d)
    lens_t = torch.tensor(lens, dtype=torch.int32)

    def attend(rows: slice, table: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(lens[rows]), heads * d)
        n = lens_t[rows]
        kernels.paged_decode_attention(
            q[rows], k_cache, v_cache, table, n, int(n.max()), out, 0.125
        )
        return out

    together = attend(slice(None), table)
    chunk = attend(slice(0, 9), ours.unsqueeze(0).expand(9, -1))  # a prefill chunk's table
    for r in range(len(lens)):
        alone = attend(slice(r, r + 1), table[r : r + 1])
        assert torch.equal(alone[0], together[r]), (r, lens[r])
        if r < 9:
            assert torch.equal(alone[0], chunk[r]), (r, lens[r])


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


def test_isa_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    best = cpu_kernels.detect_isa()
    assert cpu_kernels.available_isas()[0] == best
    assert cpu_kernels.available_isas()[-1] == "portable"
    monkeypatch.delenv("TREADLE_CPU_ISA", raising=False)
    assert cpu_kernels.select_isa() == best
    monkeypatch.setenv("TREADLE_CPU_ISA", "portable")
    assert cpu_kernels.select_isa() == "portable"
    monkeypatch.setenv("TREADLE_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="avx512vnni, avx512, avx2vnni, avx2, portable"):
        cpu_kernels.select_isa()
    # a level this CPU lacks is refused, never built and run
    for level in set(cpu_kernels.ISA_LEVELS) - set(cpu_kernels.available_isas()):
        monkeypatch.setenv("TREADLE_CPU_ISA", level)
        with pytest.raises(ValueError, match="this CPU runs only"):
            cpu_kernels.select_isa()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 flags: only on x86-64")
def test_levels_follow_the_flags_not_an_order(monkeypatch: pytest.MonkeyPatch) -> None:
    v3 = {"avx", "avx2", "fma", "f16c"}
    v4 = v3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
    for flags, want in (
        (v4 | {"avx512_vnni"}, ["avx512vnni", "avx512", "avx2", "portable"]),  # Zen 4
        (v4 | {"avx512_vnni", "avx_vnni"}, cpu_kernels.ISA_LEVELS),  # Sapphire Rapids
        (v3 | {"avx_vnni"}, ["avx2vnni", "avx2", "portable"]),  # Alder Lake, Sierra Forest
        (v3, ["avx2", "portable"]),
        ({"sse4_2"}, ["portable"]),
    ):
        monkeypatch.setattr(kernel_lib, "cpu_flags", lambda flags=flags: flags)
        assert cpu_kernels.available_isas() == list(want)
        assert cpu_kernels.detect_isa() == want[0]


def test_each_level_is_its_own_library_that_says_its_level() -> None:
    names = set()
    for isa in cpu_kernels.available_isas():
        kernels = cpu_kernels.kernels_for(isa)
        assert kernels.isa == isa and f"_{isa}_" in kernels.path.name
        names.add(kernels.path.name)
    assert len(names) == len(cpu_kernels.available_isas())


def test_the_cache_key_holds_the_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another compiler (here: the same one behind a wrapper that says another version) builds
    another library, so a cache shared between machines never hands out a foreign build."""
    monkeypatch.setenv("TREADLE_CACHE_DIR", str(tmp_path))
    first = cpu_kernels._build("portable")
    wrapper = tmp_path / "othercc"
    wrapper.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo "othercc 99.1" && exit 0\nexec cc "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    second = cpu_kernels._build("portable")
    assert first != second and first.exists() and second.exists()
    assert cpu_kernels._build("portable") == second  # and the cache is used


def test_an_unwritable_cache_still_builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory should be")
    monkeypatch.setenv("TREADLE_CACHE_DIR", str(blocked))
    path = cpu_kernels._build("portable")
    assert path.exists() and not str(path).startswith(str(blocked))
    assert cpu_kernels.Kernels("portable", path).isa == "portable"


def test_the_library_opens_and_the_level_is_chosen_without_torch() -> None:
    """`kernel_lib` (the level, the signatures, the fused decode's structs) and `gguf_layout`
    (the weights' layouts) are what a process without PyTorch shares with `cpu_kernels` and
    `quantized` (docs/design/torch-free-engine-core.md)."""
    code = (
        "import sys\n"
        "from treadle.model import kernel_build, kernel_lib\n"
        "isa = kernel_lib.select_isa()\n"
        "lib = kernel_lib.open_library(isa, kernel_build.build(isa))\n"
        "assert lib.gguf_linear_i8_max_rows() > 0\n"
        "assert kernel_lib.DecodeLayer.k_cache.offset > 0 and kernel_lib.DecodeModel().eps == 0\n"
        "import numpy as np\n"
        "from treadle.model import gguf_layout as g\n"
        "raw = np.random.default_rng(0).integers(0, 256, (32, 2 * 20), dtype=np.uint8)\n"
        "tiles, kind, k = g.tile_layout([g.GGUFBlocks('Q4_1', raw)], 32)\n"
        "assert tiles.shape == (8, 2, 4, 20) and kind == g.KIND_Q4 and k == 64\n"
        "assert g.g16_layout(tiles, kind, in_place=True).shape == (2, 2, 320)\n"
        "print(isa, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split() == [cpu_kernels.select_isa(), "False"], out.stderr
