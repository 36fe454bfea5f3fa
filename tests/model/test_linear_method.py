"""oneDNN sees few row counts: the packed method runs whole buckets and padded remainders, a GGUF
layer sends the rows past its last whole bucket to its blocks; every row count gives the same
product as the plain weight. (Each row count oneDNN sees is a cached primitive of ~250 KB: one
per prefill length grew a serving engine core without bound, issue 28.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_quantized import dequantized, random_blocks

from treadle.model import cpu_kernels, linear_method
from treadle.model.linear_method import ROW_BUCKET, SMALL_ROW_STEP, GGUFLinear, PackedLinear
from treadle.model.quantized import QuantizedWeight

ROW_COUNTS = [3, 4, 7, 8, 9, 31, 63, 64, 65, 100, 127, 128, 129, 200, 257]


@pytest.fixture
def onednn_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts that reach oneDNN."""
    seen: list[int] = []
    real = linear_method.onednn_linear

    def spy(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen.append(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(linear_method, "onednn_linear", spy)
    return seen


def packed_method(weight: torch.Tensor) -> PackedLinear:
    packed = linear_method.pack_weight(weight)
    if packed is None:
        pytest.skip("no oneDNN weight packing in this PyTorch build (or TREADLE_CPU_KERNELS=0)")
    return PackedLinear(weight, packed)


def allowed(rows: int) -> bool:
    return rows % ROW_BUCKET == 0 or (rows < ROW_BUCKET and rows % SMALL_ROW_STEP == 0)


@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_rows_are_bucketed_and_exact(
    onednn_rows: list[int], rows: int, with_bias: bool
) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 128)
    bias = torch.randn(96) if with_bias else None
    method = packed_method(weight)
    x = torch.randn(rows, 160)[:, 16:144]  # strided rows, as a slice of a fused output
    torch.testing.assert_close(method.apply(x, bias), F.linear(x, weight, bias))
    assert onednn_rows and all(allowed(r) for r in onednn_rows), onednn_rows
    assert sum(onednn_rows) - rows < SMALL_ROW_STEP  # padding only the last few rows


def test_a_prefill_of_every_length_meets_few_shapes(onednn_rows: list[int]) -> None:
    method = packed_method(torch.randn(32, 64))
    for rows in range(3, 2049, 7):
        method.apply(torch.randn(rows, 64), None)
    assert len(set(onednn_rows)) <= 2048 // ROW_BUCKET + ROW_BUCKET // SMALL_ROW_STEP


@pytest.mark.skipif(
    cpu_kernels.load() is None, reason="no C compiler here (or TREADLE_CPU_KERNELS=0)"
)
@pytest.mark.parametrize("rows", [65, 100, 128, 129, 200])
def test_gguf_layer_sends_whole_buckets_beyond_and_the_rest_to_its_blocks(
    onednn_rows: list[int], rows: int
) -> None:
    kernels = cpu_kernels.kernels_for(cpu_kernels.detect_isa())
    blocks = random_blocks("Q4_1", 96, 128, seed=rows)
    quant = QuantizedWeight.build([blocks], 96, torch.device("cpu"))
    assert quant is not None
    reference = dequantized(blocks)
    method = GGUFLinear(kernels, quant, packed_method(reference.clone()), max_rows=ROW_BUCKET)
    x = torch.randn(rows, 128)
    bias = torch.randn(96)
    expected = F.linear(x, reference, bias)
    got = method.apply(x, bias)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert onednn_rows == [rows - rows % ROW_BUCKET]


@pytest.mark.skipif(
    cpu_kernels.load() is None or not torch.backends.mkldnn.is_available(),
    reason="no C compiler here (or TREADLE_CPU_KERNELS=0), or no oneDNN",
)
@pytest.mark.parametrize("rows", [65, 255, 256, 300, 513])
def test_a_layer_kept_as_blocks_expands_them_for_many_rows(
    onednn_rows: list[int], rows: int
) -> None:
    """No packed copy: from EXPAND_MIN_ROWS rows the whole buckets go to oneDNN on the blocks
    expanded into the scratch, the rest (and fewer rows) to the blocks' kernel."""
    kernels = cpu_kernels.kernels_for(cpu_kernels.detect_isa())
    blocks = random_blocks("Q4_1", 96, 128, seed=rows)
    quant = QuantizedWeight.build([blocks], 96, torch.device("cpu"))
    assert quant is not None
    method = GGUFLinear(kernels, quant, linear_method.ExpandedLinear(kernels, quant), ROW_BUCKET)
    x = torch.randn(rows, 128)
    bias = torch.randn(96)
    expected = F.linear(x, dequantized(blocks), bias)
    got = method.apply(x, bias)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    whole = rows - rows % ROW_BUCKET
    assert onednn_rows == ([whole] if whole >= linear_method.EXPAND_MIN_ROWS else [])
