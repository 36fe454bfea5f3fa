"""The fused decode path (one C call for all decoder layers) against the modules, at every ISA
level this CPU runs: the same hidden states and the same KV cache writes, to the bit."""

from __future__ import annotations

import pytest
import torch

from treadle.config import resolve_model
from treadle.model import cpu_kernels, linear_method
from treadle.model.attention import AttentionMetadata
from treadle.model.loader import load_model, read_arch

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None,
    reason="no C compiler here (or TREADLE_CPU_KERNELS=0): the kernels cannot be built",
)


def decode_step(
    model, lengths: list[int], kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """One decode token per request, the request's context `length` tokens long (the new one
    included), its blocks scattered over the cache (shared between requests where the cache
    is too small: both paths read and write in the same order, so that is no matter)."""
    num_blocks, block_size = kv_caches[0][0].shape[1:3]
    max_blocks = -(-max(lengths) // block_size)
    table = torch.arange(len(lengths) * max_blocks).view(len(lengths), max_blocks).flip(1)
    table = (table * 7) % num_blocks
    slots = [int(table[r, (n - 1) // block_size]) * block_size + (n - 1) % block_size
             for r, n in enumerate(lengths)]  # fmt: skip
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=len(lengths),
        decode_block_table=table,
        decode_lens=torch.tensor(lengths, dtype=torch.int32),
        decode_max_len=max(lengths),
    )
    ids = torch.tensor([1000 + 7 * n for n in lengths])
    positions = torch.tensor([n - 1 for n in lengths])
    with torch.inference_mode():
        return model(ids, positions, kv_caches, meta)


@pytest.mark.parametrize(
    ("isa", "activations"),
    [(isa, "float32") for isa in cpu_kernels.available_isas()]
    + [(cpu_kernels.available_isas()[0], a) for a in ("int8", "int8x2")],
)
def test_fused_decode_matches_the_modules(
    default_model_path: str, isa: str, activations: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TREADLE_CPU_ISA", isa)
    monkeypatch.setattr(cpu_kernels, "_selected", [])
    source = resolve_model(default_model_path)
    arch = read_arch(source)
    model = load_model(source, arch, torch.float32, torch.device("cpu"), 512, activations)
    fused = model.fused
    if linear_method.GGUF_MAX_ROWS[isa] == 0:  # no linear layer on the blocks: no fused path
        assert fused is None
        return
    assert fused is not None and fused.kernels.isa == isa
    assert fused.kernels.activations == activations
    torch.manual_seed(0)
    shape = (model.num_kv_heads, 64, 16, model.head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(model.num_layers)]
    for lengths in ([1], [37], [5, 20, 37, 300], list(range(3, 3 + 5 * fused.max_rows, 5))):
        lengths = lengths[: fused.max_rows]
        ours = [(k.clone(), v.clone()) for k, v in caches]
        theirs = [(k.clone(), v.clone()) for k, v in caches]
        got = decode_step(model, lengths, ours)
        model.fused = None  # the modules
        try:
            expected = decode_step(model, lengths, theirs)
        finally:
            model.fused = fused
        assert torch.equal(got, expected), lengths
        assert all(
            torch.equal(a, b) for pair, other in zip(ours, theirs, strict=True)
            for a, b in zip(pair, other, strict=True)
        )  # fmt: skip


def test_fused_decode_does_not_apply_without_gguf_blocks(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    """A safetensors model has no blocks: the modules run every step."""
    source = resolve_model(str(tiny_model_factory("llama")))
    model = load_model(source, read_arch(source), torch.float32, torch.device("cpu"), 64)
    assert model.fused is None
