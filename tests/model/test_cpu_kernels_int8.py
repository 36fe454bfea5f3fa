"""The int8-activation GGUF kernel (`csrc/int8.h`, `gguf_linear_i8`) against a reference in
Python that quantizes the activations the same way and takes the integer dot products exactly:
at every ISA level this CPU runs (avx512vnni: vpdpbusd on two blocks at once, avx512: the same
with maddubs + madd, avx2: maddubs + madd on one block, portable: plain loops), for Q4_0, Q4_1 and Q8_0 blocks, 1 to 11 rows (every remainder of the
levels' row groups), strided rows, output sizes that are not whole tiles. Only the float32
sums of the per-block terms may differ in order, so the tolerance is tight. Beyond the level's
`int8_max_rows` the product is the float32 kernel's, to the bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.model import cpu_kernels, linear_method
from treadle.model.cpu_kernels import Kernels
from treadle.model.linear_method import DenseLinear, GGUFLinear
from treadle.model.quantized import GGUFBlocks, QuantizedWeight

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None,
    reason="no C compiler here (or TREADLE_CPU_KERNELS=0): the kernel cannot be built",
)


@pytest.fixture(params=cpu_kernels.available_isas())
def kernels(request: pytest.FixtureRequest) -> Kernels:
    return cpu_kernels.kernels_for(request.param).with_activations("int8")


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> GGUFBlocks:
    """Valid GGUF blocks: half scales (and Q4_1 mins), random quants (Q8_0: -128 included)."""
    rng = np.random.default_rng(seed)
    nb = cols // 32
    d = (rng.random((rows, nb, 1)) * 0.02 + 0.001).astype(np.float16).view(np.uint8)
    if kind == "Q8_0":
        parts = [d, rng.integers(-128, 128, (rows, nb, 32), dtype=np.int8).view(np.uint8)]
    else:
        qs = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
        m = (-rng.random((rows, nb, 1)) * 0.1).astype(np.float16).view(np.uint8)
        parts = [d, m, qs] if kind == "Q4_1" else [d, qs]
    return GGUFBlocks(kind, np.concatenate(parts, axis=-1).reshape(rows, -1))


def quantize_activations(
    x: torch.Tensor, d: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_1 in float32 as the kernel does it: per block of 32, d = max|x| / 127
    (or the scales `d` given), p = round(x / d) (half to even) within -127..127, s = d *
    sum(p). Returns p [M, nb, 32] int64, d and s [M, nb] float32."""
    blocks = x.reshape(x.shape[0], -1, 32)
    if d is None:
        d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    p = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int64)
    s = d * p.sum(-1).to(torch.float32)
    return p, d, s


def weight_quants(blocks: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, nb, 32] int64, d and m [N, nb] float32 with w = d q + m (Q4_0: m = -8 d in half
    precision, as the kernel's layout)."""
    n = blocks.raw.shape[0]
    nbytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[blocks.kind]
    raw = blocks.raw.reshape(n, -1, nbytes)
    d16 = raw[..., 0:2].copy().view(np.float16)[..., 0]
    if blocks.kind == "Q8_0":
        q = raw[..., 2:].copy().view(np.int8).astype(np.int64)
        m16 = np.zeros_like(d16)
    else:
        qs = raw[..., -16:].astype(np.int64)
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)
        m16 = (
            raw[..., 2:4].copy().view(np.float16)[..., 0]
            if blocks.kind == "Q4_1"
            else d16 * np.float16(-8)
        )
    return (
        torch.from_numpy(q),
        torch.from_numpy(d16.astype(np.float32)),
        torch.from_numpy(m16.astype(np.float32)),
    )


def reference(
    x: torch.Tensor, blocks: GGUFBlocks, d: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, the sum of |terms|) in float64 from the exact integer dot products per block (x
    quantized on the scales `d` if given)."""
    p, dx, sx = quantize_activations(x, d)
    q, dw, mw = weight_quants(blocks)
    sumi = torch.einsum("rbi,nbi->rnb", p, q).to(torch.float64)
    terms = (dw[None].double() * dx[:, None].double()) * sumi + mw[None].double() * sx[
        :, None
    ].double()
    return terms.sum(-1), terms.abs().sum(-1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 11])
def test_int8_kernel_matches_the_exact_integer_reference(
    kernels: Kernels, kind: str, rows: int
) -> None:
    blocks = random_blocks(kind, 203, 576, seed=rows)  # 203: not a whole number of tiles
    weight = QuantizedWeight.build([blocks], 203, torch.device("cpu"))
    assert weight is not None
    torch.manual_seed(rows)
    x = torch.randn(rows, 700)[:, 50:626]  # strided rows
    x[0, :32] = 0.0  # a block of zeros (d = 0)
    got = GGUFLinear(kernels, weight, DenseLinear(torch.empty(0)), max_rows=1 << 20).apply(x, None)
    if rows > kernels.int8_max_rows:
        exact = cpu_kernels.kernels_for(kernels.isa)
        assert torch.equal(got, exact.gguf_linear(x, weight.tiles, weight.kind, 203))
        return
    expected, magnitude = reference(x.contiguous(), blocks)
    # float32 sums of 18 blocks' terms in another order: a few ulps of their magnitude
    assert ((got.double() - expected).abs() <= 1e-6 * magnitude + 1e-30).all()


def test_int8_is_close_to_float32_and_the_exact_path_stays(kernels: Kernels) -> None:
    """int8 activations move a product by about 1% of its size; the float32 kernels of the same
    level are untouched by `with_activations`."""
    blocks = random_blocks("Q4_1", 64, 1536, seed=0)
    weight = QuantizedWeight.build([blocks], 64, torch.device("cpu"))
    assert weight is not None
    x = torch.randn(4, 1536)
    exact = cpu_kernels.kernels_for(kernels.isa)
    assert exact.activations == "float32" and kernels.activations == "int8"
    a = exact.gguf_linear(x, weight.tiles, weight.kind, 64)
    b = kernels.gguf_linear(x, weight.tiles, weight.kind, 64)
    assert not torch.equal(a, b)
    assert (a - b).norm() <= 0.02 * a.norm()
    assert exact.with_activations("float32") is exact
    with pytest.raises(ValueError, match="int4"):
        exact.with_activations("int4")


# ---- 16 outputs wide (`QuantizedWeight.to_g16`, csrc/int8.h) ---------------------------------

KINDS = {"Q4_0": 0, "Q4_1": 0, "Q8_0": 1}  # the kernel's block kind of each GGUF type


def g16_weight(kind: str, n: int, k: int, seed: int) -> tuple[GGUFBlocks, QuantizedWeight]:
    blocks = random_blocks(kind, n, k, seed)
    tiled = QuantizedWeight.build([blocks], n, torch.device("cpu"))
    assert tiled is not None
    return blocks, tiled.to_g16()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, 70])
def test_g16_matches_the_exact_integer_reference_at_every_row_count(
    kernels: Kernels, kind: str, rows: int
) -> None:
    if not kernels.g16_kinds >> KINDS[kind] & 1:
        # (int8.h: portable runs none): such a layer keeps its tiles
        tiled = QuantizedWeight.build([random_blocks(kind, 8, 64, 0)], 8, torch.device("cpu"))
        assert tiled is not None and linear_method.for_activations(tiled, kernels) is tiled
        return
    blocks, weight = g16_weight(kind, 203, 576, seed=rows)  # 203: not a whole group
    torch.manual_seed(rows)
    x = torch.randn(rows, 700)[:, 50:626]  # strided rows
    x[0, :32] = 0.0  # a block of zeros (d = 0)
    got = GGUFLinear(kernels, weight, None, max_rows=1 << 20).apply(x, None)
    expected, magnitude = reference(x.contiguous(), blocks)
    assert ((got.double() - expected).abs() <= 1e-6 * magnitude + 1e-30).all()
    # Each row's bits are its own: the same alone as among the others (a speculative step's
    # rows give the logits of single-row steps).
    for r in range(rows):
        assert torch.equal(
            got[r], kernels.gguf_linear(x[r : r + 1], weight.tiles, weight.kind, 203)[0]
        )


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_int8x2_takes_each_row_as_its_blocks_and_their_rounding(
    kernels: Kernels, kind: str, rows: int
) -> None:
    """int8x2: each row quantized, then what the rounding left quantized again on 1/256 of
    the first's scale, both products added (`quantize_row_q8_x2`): the exact integer
    reference of those two rows, each row's bits its own, and ~1e-5 of float32's product
    where int8 alone is ~1e-2 away."""
    x2 = kernels.with_activations("int8x2")
    if not kernels.g16_kinds >> KINDS[kind] & 1:  # no 16-wide layout: the float32 product
        return
    blocks, weight = g16_weight(kind, 203, 576, seed=rows)
    torch.manual_seed(rows)
    x = torch.randn(rows, 700)[:, 50:626]  # strided rows
    x[0, :32] = 0.0  # a block of zeros (d = 0): its rest is zero too
    got = GGUFLinear(x2, weight, None, max_rows=1 << 20).apply(x, None)
    p, d, _ = quantize_activations(x.contiguous())
    # x - d p in one rounding, as the C's FMA (every level with 16-wide kernels has one)
    rest = (x.reshape(rows, -1, 32).double() - d[..., None].double() * p.double()).float()
    first, magnitude = reference(x.contiguous(), blocks)
    second, _ = reference(rest.reshape(rows, -1), blocks, d / 256)
    assert ((got.double() - (first + second)).abs() <= 1e-6 * magnitude).all()
    for r in range(rows):
        assert torch.equal(got[r], x2.gguf_linear(x[r : r + 1], weight.tiles, weight.kind, 203)[0])
    tiled = QuantizedWeight.build([blocks], 203, torch.device("cpu"))
    assert tiled is not None
    exact = cpu_kernels.kernels_for(kernels.isa).gguf_linear(x, tiled.tiles, tiled.kind, 203)
    one = GGUFLinear(kernels, weight, None, max_rows=1 << 20).apply(x, None)
    assert (got - exact).norm() <= 1e-4 * exact.norm()
    assert (got - exact).norm() * 30 <= (one - exact).norm()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_int8x2_expands_its_blocks_for_many_rows(kernels: Kernels) -> None:
    """A prefill's products (from the level's `EXPAND_MIN_ROWS_INT8X2` rows, whole multiples of
    64) are faster as oneDNN's float32 GEMM on the blocks expanded than as twice the rows in
    integers: float32's product there, int8x2's on the rows past the last multiple of 64 and
    on fewer rows."""
    x2 = kernels.with_activations("int8x2")
    if not kernels.g16_kinds >> KINDS["Q4_1"] & 1:
        return
    blocks, _ = g16_weight("Q4_1", 96, 576, seed=0)
    tiled = QuantizedWeight.build([blocks], 96, torch.device("cpu"))
    assert tiled is not None
    expand = linear_method.expand_min_rows(x2, g16_weight("Q4_1", 16, 64, seed=0)[1])
    assert expand % linear_method.ROW_BUCKET == 0
    if expand == linear_method.NEVER:  # (AMD's AVX-512 CPUs: the blocks at every row count)
        assert linear_method._amd_avx512() and kernels.isa != "portable"
        x = torch.randn(2 * 1024 + 44, 576)
        method = linear_method.choose(torch.nn.Parameter(torch.empty(96, 576)), tiled, x2)
        blocks_alone = x2.gguf_linear(x, method.quant.tiles, method.quant.kind, 96)
        assert torch.equal(method.apply(x, None), blocks_alone)
        return
    x = torch.randn(expand + 44, 576)
    exact = cpu_kernels.kernels_for(kernels.isa).gguf_linear(x, tiled.tiles, tiled.kind, 96)
    method = linear_method.choose(torch.nn.Parameter(torch.empty(96, 576)), tiled, x2)
    assert isinstance(method, GGUFLinear) and isinstance(
        method.beyond, linear_method.ExpandedLinear
    )
    assert tiled.tiles.numel() == 0  # laid out anew in its own memory: no copy kept
    got = method.apply(x, None)
    blocks_alone = x2.gguf_linear(x, method.quant.tiles, method.quant.kind, 96)
    assert torch.allclose(got[:expand], exact[:expand], rtol=1e-4, atol=1e-4)
    assert not torch.equal(got[:expand], blocks_alone[:expand])
    assert torch.equal(got[expand:], blocks_alone[expand:])
    assert torch.equal(method.apply(x[:40], None), blocks_alone[:40])


def test_a_kind_the_level_does_not_run_16_wide_gives_nan(kernels: Kernels) -> None:
    missing = [k for k in ("Q4_1", "Q8_0") if not kernels.g16_kinds >> KINDS[k] & 1]
    if not missing:
        assert kernels.isa != "portable"  # every x86 level runs both kinds
        return
    _, weight = g16_weight(missing[0], 32, 64, seed=0)
    assert kernels.gguf_linear(torch.randn(2, 64), weight.tiles, weight.kind, 32).isnan().all()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_g16_holds_the_same_weights(kind: str) -> None:
    """Laid out anew, not changed: its expansion (for oneDNN's many-row products) and its rows
    (an embedding lookup of a tied LM head) are the tiles' to the bit."""
    blocks, g16 = g16_weight(kind, 37, 96, seed=3)
    tiled = QuantizedWeight.build([blocks], 37, torch.device("cpu"))
    assert tiled is not None
    assert g16.tiles.shape == (3, 3, 320 if KINDS[kind] == 0 else 544)
    exact = cpu_kernels.kernels_for(cpu_kernels.select_isa())
    a = exact.gguf_dequantize(tiled.tiles, tiled.kind, 37, torch.empty(37 * 96)).clone()
    b = exact.gguf_dequantize(g16.tiles, g16.kind, 37, torch.empty(37 * 96))
    assert torch.equal(a, b)
    assert torch.equal(a, torch.from_numpy(blocks.dequantize()))
    ids = torch.tensor([0, 5, 15, 16, 36, 5])
    assert torch.equal(g16.dequantize_rows(ids), tiled.dequantize_rows(ids))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_c_row_lookup_gives_gguf_s_values(kernels: Kernels, kind: str) -> None:
    """`Kernels.gguf_rows` (an embedding kept only as blocks, looked up each step) gives the
    rows `dequantize_rows` gives, to the bit (d q is exact in float32: fused or not), from the
    tiles and from the 16-wide layout; an id outside the table gives zeros."""
    blocks, g16 = g16_weight(kind, 37, 96, seed=4)
    tiled = QuantizedWeight.build([blocks], 37, torch.device("cpu"))
    assert tiled is not None
    ids = torch.tensor([0, 5, 15, 16, 36, 5, 37, -1])
    want = torch.from_numpy(blocks.dequantize())[ids[:6]]
    for w in (tiled, g16):
        got = kernels.gguf_rows(w.tiles, w.kind, 37, ids)
        assert torch.equal(got[:6], want) and torch.equal(got[:6], w.dequantize_rows(ids[:6]))
        assert not got[6:].any()
