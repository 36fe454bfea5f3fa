"""The GGUF-block linear kernel against `gguf`'s own dequantization, at every ISA level this CPU
runs (`portable` always): random blocks of each type the kernel reads, 0 to 96 rows (both of
its paths: blocks expanded in registers up to 2 rows, tiles expanded once beyond, with every
remainder of the register tiles' row groups), output sizes that are not whole tiles, strided
rows, a bias, and the row/column slices that tensor parallelism takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from treadle import envs
from treadle.model import cpu_kernels, linear_method, quantized
from treadle.model.cpu_kernels import Kernels
from treadle.model.linear_method import DenseLinear, GGUFLinear
from treadle.model.quantized import GGUFBlocks, QuantizedWeight

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None,
    reason="no C compiler here (or TREADLE_CPU_KERNELS=0): the kernel cannot be built",
)


@pytest.fixture(params=cpu_kernels.available_isas())
def kernels(request: pytest.FixtureRequest) -> Kernels:
    return cpu_kernels.kernels_for(request.param)


def gguf_linear(
    kernels: Kernels, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    method = GGUFLinear(kernels, weight, DenseLinear(torch.empty(0)), max_rows=1 << 20)
    return method.apply(x, bias)


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> GGUFBlocks:
    """Valid GGUF blocks: fp16 scales (and mins), random quants."""
    rng = np.random.default_rng(seed)
    nb = cols // 32
    d = (rng.random((rows, nb, 1)) * 0.02 + 0.001).astype(np.float16).view(np.uint8)
    if kind == "Q8_0":
        qs = rng.integers(-128, 128, (rows, nb, 32), dtype=np.int8).view(np.uint8)
        parts = [d, qs]
    else:
        qs = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
        parts = [d, qs]
        if kind == "Q4_1":
            m = (-rng.random((rows, nb, 1)) * 0.1).astype(np.float16).view(np.uint8)
            parts = [d, m, qs]
    return GGUFBlocks(kind, np.concatenate(parts, axis=-1).reshape(rows, -1))


def dequantized(blocks: GGUFBlocks) -> torch.Tensor:
    import gguf
    from gguf.quants import dequantize

    kind = gguf.GGMLQuantizationType[blocks.kind]
    return torch.from_numpy(np.array(dequantize(blocks.raw, kind), dtype=np.float32))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 10, 11, 12, 13, 64, 96])
def test_kernel_matches_the_dequantized_weight(kernels: Kernels, kind: str, rows: int) -> None:
    blocks = random_blocks(kind, 203, 576)  # 203: not a whole number of tiles
    weight = QuantizedWeight.build([blocks], 203, torch.device("cpu"))
    assert weight is not None
    reference = dequantized(blocks)
    torch.manual_seed(rows)
    x = torch.randn(rows, 700)[:, 50:626]  # strided rows, as the slices of a fused output
    bias = torch.randn(203)
    got = gguf_linear(kernels, x, weight, bias)
    expected = F.linear(x, reference, bias)
    assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_zero_rows() -> None:
    weight = QuantizedWeight.build([random_blocks("Q4_1", 8, 64)], 8, torch.device("cpu"))
    assert weight is not None
    assert gguf_linear(cpu_kernels.kernels_for("portable"), torch.empty(0, 64), weight).shape == (
        0,
        8,
    )


def test_shards_and_stacked_parts_match(kernels: Kernels) -> None:
    """Rows of two parts stacked (q/k/v, gate/up), then a column shard (row-parallel)."""
    a, b = random_blocks("Q4_1", 64, 1536, seed=1), random_blocks("Q4_1", 32, 1536, seed=2)
    full = torch.cat([dequantized(a), dequantized(b)])
    x = torch.randn(2, 768)
    parts = [a.rows(16, 40).cols(768, 768), b.cols(768, 768)]
    weight = QuantizedWeight.build(parts, 72, torch.device("cpu"))
    assert weight is not None and weight.in_features == 768
    expected = F.linear(x, torch.cat([full[16:56], full[64:]])[:, 768:])
    got = gguf_linear(kernels, x, weight)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_padding_rows_give_zero_logits(kernels: Kernels) -> None:
    """The last TP rank's vocabulary shard is padded: those rows come out as zeros."""
    blocks = random_blocks("Q8_0", 10, 64)
    weight = QuantizedWeight.build([blocks], 16, torch.device("cpu"))
    assert weight is not None
    out = gguf_linear(kernels, torch.randn(1, 64), weight)
    assert out.shape == (1, 16) and bool((out[:, 10:] == 0).all()) and bool(out[:, :10].abs().sum())


def test_when_the_kernel_does_not_apply() -> None:
    q4 = random_blocks("Q4_1", 8, 64)
    assert QuantizedWeight.build([q4, None], 16, torch.device("cpu")) is None
    assert (
        QuantizedWeight.build([q4, random_blocks("Q8_0", 8, 64)], 16, torch.device("cpu")) is None
    )
    assert q4.cols(16, 32) is None  # not on a block boundary
    weight = torch.nn.Parameter(dequantized(q4))
    quant = QuantizedWeight.build([q4], 8, torch.device("cpu"))
    # no kernels (bfloat16, CUDA, TREADLE_CPU_KERNELS=0): the weight itself, or its packed copy
    assert not isinstance(linear_method.choose(weight, quant, None), GGUFLinear)
    # a level where the blocks are never the faster copy (portable) does not use them either
    portable = cpu_kernels.kernels_for("portable")
    assert linear_method.GGUF_MAX_ROWS["portable"] == 0
    assert not isinstance(linear_method.choose(weight, quant, portable), GGUFLinear)
    best = cpu_kernels.kernels_for(cpu_kernels.detect_isa())
    if linear_method.GGUF_MAX_ROWS[best.isa] == 0:
        pytest.skip(f"this CPU's best level ({best.isa}) never uses the blocks")
    method = linear_method.choose(weight, quant, best)
    assert isinstance(method, GGUFLinear)
    # beyond the crossover, the blocks as well (or the packed copy: see the next test)
    x = torch.randn(method.max_rows + 1, 64)
    torch.testing.assert_close(method.apply(x, None), F.linear(x, dequantized(q4)))


@pytest.mark.parametrize("packed", [False, True])
def test_a_layer_on_its_blocks_keeps_no_float32_copy_unless_asked(
    monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    """By default a layer on its blocks takes them for every row count and frees its float32
    weight; TREADLE_PACKED_GGUF_WEIGHTS=1 keeps oneDNN's packed copy for the rows beyond."""
    best = cpu_kernels.kernels_for(cpu_kernels.detect_isa())
    if linear_method.GGUF_MAX_ROWS[best.isa] == 0:
        pytest.skip(f"this CPU's best level ({best.isa}) never uses the blocks")
    monkeypatch.setenv("TREADLE_PACKED_GGUF_WEIGHTS", "1" if packed else "0")
    q4 = random_blocks("Q4_1", 96, 128)
    quant = QuantizedWeight.build([q4], 96, torch.device("cpu"))
    assert linear_method.on_blocks_only(quant, best) is not packed
    weight = torch.nn.Parameter(dequantized(q4))
    method = linear_method.choose(weight, quant, best)
    assert isinstance(method, GGUFLinear) and weight.numel() == 0
    if packed and linear_method.pack_weight(torch.ones(8, 8)) is not None:
        assert isinstance(method.beyond, linear_method.PackedLinear)
    elif not packed and torch.backends.mkldnn.is_available():
        assert isinstance(method.beyond, linear_method.ExpandedLinear)
    x = torch.randn(200, 128)
    expected = F.linear(x, dequantized(q4))
    assert (method.apply(x, None) - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_tiles_expand_to_the_dequantized_weight(kernels: Kernels, kind: str) -> None:
    blocks = random_blocks(kind, 203, 576, seed=4)  # 203: a last partial tile
    weight = QuantizedWeight.build([blocks], 203, torch.device("cpu"))
    assert weight is not None
    scratch = torch.full((203 * 576 + 5,), float("nan"))
    got = kernels.gguf_dequantize(weight.tiles, weight.kind, 203, scratch)
    reference = dequantized(blocks).view(203, 576)
    assert got.shape == (203, 576)
    assert (got - reference).abs().max() <= 1e-6 * reference.abs().max()  # d q + m: one fma
    assert bool(scratch[203 * 576 :].isnan().all())  # nothing written past the weight


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_rows_looked_up_in_the_blocks_are_gguf_values(kind: str) -> None:
    """An embedding table kept only as blocks: its rows, bit for bit gguf's dequantization."""
    blocks = random_blocks(kind, 203, 576, seed=3)
    weight = QuantizedWeight.build([blocks], 204, torch.device("cpu"))
    assert weight is not None
    ids = torch.tensor([[0, 202, 7], [5, 5, 100]])
    got = weight.dequantize_rows(ids)
    assert got.shape == (6, 576) and got.dtype == torch.float32
    assert torch.equal(got, dequantized(blocks).view(203, 576)[ids.reshape(-1)])
    assert np.array_equal(blocks.dequantize(), dequantized(blocks).view(203, 576).numpy())


def _load_default(path: str) -> torch.nn.Module:
    from treadle.config import resolve_model
    from treadle.model.loader import load_model, read_arch

    source = resolve_model(path)
    return load_model(source, read_arch(source), torch.float32, torch.device("cpu"), 64)


def _gguf_values(path: str, name: str) -> torch.Tensor:
    from treadle.model.gguf_file import GGUFFile

    tensor = next(t for t in GGUFFile(path).tensors if t.name == name)
    return torch.from_numpy(tensor.dequantize())


@pytest.mark.usefixtures("gguf_block_kernels")  # the loader puts layers on their blocks
def test_default_model_decodes_on_the_gguf_blocks(default_model_path: str) -> None:
    """Every linear layer and the LM head of the default Q4_1/Q8_0 model runs on its blocks
    alone: no float32 weight, no packed copy; the (tied) embedding looks rows up in them."""
    if envs.packed_gguf_weights():
        pytest.skip(
            "TREADLE_PACKED_GGUF_WEIGHTS=1 keeps oneDNN's packed copy beside the blocks (its "
            "point); runs without it"
        )
    model = _load_default(default_model_path)
    arch = model.arch
    linears = [m for m in model.modules() if hasattr(m, "method") and m is not model.lm_head]
    assert len(linears) == 4 * arch.num_layers
    assert all(isinstance(m.method, GGUFLinear) for m in linears)
    if torch.backends.mkldnn.is_available():  # many rows: the blocks expanded into a scratch
        assert all(isinstance(m.method.beyond, linear_method.ExpandedLinear) for m in linears)
    assert all(m.weight.numel() == 0 for m in linears)
    head = model.lm_head.method
    assert isinstance(head, GGUFLinear) and head.quant.kind == quantized.KIND_Q8
    assert head.beyond is None and model.lm_head.weight.numel() == 0
    ids = torch.tensor([0, 1, 17, 4096, arch.vocab_size - 1])
    table = _gguf_values(default_model_path, "token_embd.weight")
    assert torch.equal(model.model.embed_tokens(ids), table[ids])


def test_default_model_on_the_pytorch_paths_gets_gguf_values(
    default_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the C kernels the weights are float32 again: the blocks the loader kept,
    dequantized into them (rows of packed q/k/v, the tied table), bit for bit gguf's values."""
    monkeypatch.setenv("TREADLE_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_selected", [])
    model = _load_default(default_model_path)
    layer = model.model.layers[0]
    down = _gguf_values(default_model_path, "blk.0.ffn_down.weight")
    assert torch.equal(layer.mlp.down_proj.weight, down)
    v = _gguf_values(default_model_path, "blk.0.attn_v.weight")
    q_size = layer.self_attn.num_heads * layer.self_attn.head_dim
    assert torch.equal(layer.self_attn.qkv_proj.weight[q_size + v.shape[0] :], v)
    table = _gguf_values(default_model_path, "token_embd.weight")
    assert torch.equal(model.model.embed_tokens.weight, table)
