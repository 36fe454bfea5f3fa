"""A row's product on the GGUF blocks does not depend on the rows beside it (`csrc/`, every ISA
level this CPU runs): for Q4_0, Q4_1 and Q8_0 blocks, each row of an M-row call (1 to 9 rows, the
register path's row groups and the expanded-tile path, and a few larger M) is torch.equal to
that row computed alone, with float32 and with int8 activations (up to `int8_max_rows`; past
it the float32 kernel's bits) -- except that at avx2 one or two rows take the faster sum way,
whose bits a row of 3 or more does not share; and the float32 product is close to a float64
reference of the same weights. Speculative verification (k + 1 rows of one
request) and batched decode then give each position the logits of a one-row step."""

from __future__ import annotations

import pytest
import torch
from tests.model.test_cpu_kernels_int8 import random_blocks, weight_quants

from treadle.model import cpu_kernels
from treadle.model.cpu_kernels import Kernels
from treadle.model.quantized import QuantizedWeight

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None,
    reason="no C compiler here (or TREADLE_CPU_KERNELS=0): the kernel cannot be built",
)

KINDS = ["Q4_0", "Q4_1", "Q8_0"]
# (out, in): a partial last tile (203, 18), whole tiles with a long K (64, 1536), one tile (4).
SHAPES = [(203, 576), (64, 1536), (4, 32)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33]


@pytest.fixture(params=cpu_kernels.available_isas())
def kernels(request: pytest.FixtureRequest) -> Kernels:
    return cpu_kernels.kernels_for(request.param)


def weight(kind: str, n: int, k: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """The blocks in the kernels' layout and the same weight in float64 (w = d q + m)."""
    blocks = random_blocks(kind, n, k, seed=n + k)
    quant = QuantizedWeight.build([blocks], n, torch.device("cpu"))
    assert quant is not None
    q, d, m = weight_quants(blocks)
    dense = d.double()[..., None] * q.double() + m.double()[..., None]
    return quant, dense.reshape(n, k)


# Levels where 1 and 2 rows take the sum way (`csrc/avx2.h`, SUM_MAX_ROWS): there a row of a 1-
# or 2-row call has other bits (float rounding) than the same row in a call of 3 or more.
SUM_MAX_ROWS = {"avx2": 2, "avx2vnni": 2}


def each_row_alone(kernels: Kernels, x: torch.Tensor, quant: QuantizedWeight) -> torch.Tensor:
    return torch.cat(
        [kernels.gguf_linear(x[r : r + 1], quant.tiles, quant.kind, quant.out_features)
         for r in range(x.shape[0])]
    )  # fmt: skip


def each_row_among_three(kernels: Kernels, x: torch.Tensor, quant: QuantizedWeight) -> torch.Tensor:
    """Each row computed in a 3-row call (with rows 0 and 1 beside it): past the sum way."""
    return torch.cat(
        [kernels.gguf_linear(torch.cat([x[r : r + 1], x[:2]]), quant.tiles, quant.kind,
                             quant.out_features)[:1]
         for r in range(x.shape[0])]
    )  # fmt: skip


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", KINDS)
def test_each_row_is_the_bits_of_that_row_alone(
    kernels: Kernels, kind: str, shape: tuple[int, int], activations: str
) -> None:
    n, k = shape
    quant, _ = weight(kind, n, k)
    kernels = kernels.with_activations(activations)
    torch.manual_seed(n)
    x = torch.randn(max(ROWS), k + 40)[:, 20 : 20 + k]  # strided rows
    alone = each_row_alone(kernels, x, quant)
    # A row's float32 bits: alone up to the level's sum way, else among 3 or more rows. Past
    # int8_max_rows, int8 activations take the float32 kernel (faster there).
    sum_rows = SUM_MAX_ROWS.get(kernels.isa, 0)
    float32 = kernels.with_activations("float32")
    f32_alone = each_row_alone(float32, x, quant)
    f32_among = each_row_among_three(float32, x, quant) if sum_rows else f32_alone
    for rows in ROWS:
        if activations == "int8" and rows <= kernels.int8_max_rows:
            expected = alone
        else:
            expected = f32_alone if rows <= sum_rows else f32_among
        got = kernels.gguf_linear(x[:rows], quant.tiles, quant.kind, n)
        assert torch.equal(got, expected[:rows]), f"{rows} rows"
        # the same rows at another offset in the call (the row groups fall elsewhere)
        if rows > 1:
            shifted = kernels.gguf_linear(x[1 : rows + 1], quant.tiles, quant.kind, n)
            assert torch.equal(shifted, expected[1 : rows + 1]), f"{rows} rows from row 1"


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
@pytest.mark.parametrize("kind", KINDS)
def test_float32_product_is_close_to_float64(kernels: Kernels, kind: str, rows: int) -> None:
    """float32 sums of K products in some order: within a few ulps of the sum of |terms|."""
    n, k = 203, 576
    quant, dense = weight(kind, n, k)
    torch.manual_seed(rows)
    x = torch.randn(rows, k)
    got = kernels.gguf_linear(x, quant.tiles, quant.kind, n).double()
    expected = x.double() @ dense.t()
    magnitude = x.double().abs() @ dense.abs().t()
    assert ((got - expected).abs() <= 2e-6 * magnitude + 1e-30).all()
