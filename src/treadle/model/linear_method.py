"""How a linear layer computes x W^T (+ b): chosen once per layer after loading (`choose`), from
the copies of its weight it has and the row counts at which each is the fastest on this CPU.

- `DenseLinear`: the weight itself (`F.linear`): CUDA, and CPUs without oneDNN.
- `PackedLinear`: oneDNN's prepacked copy of the weight from `PACKED_MIN_ROWS` rows up (any
  rows in bfloat16): PyTorch's default CPU GEMM is fast for one row (a GEMV) but 1.5-2x slower
  than oneDNN with a prepacked weight at 4-32 rows, the rows of a decode batch.
- `GGUFLinear`: the layer's GGUF blocks through the C kernel (`quantized.py`) up to
  `GGUF_MAX_ROWS[isa]` rows: at decode sizes a step is bound by reading the weights, and the
  blocks are a fifth of the bytes of float32. Beyond, by default `ExpandedLinear` (the blocks
  expanded into a scratch buffer for oneDNN, from `EXPAND_MIN_ROWS` rows, for int8x2 from its
  level's `EXPAND_MIN_ROWS_INT8X2`; the LM head stays on its blocks), and the layer keeps no float32 weight at all (issue 24: the default model's
  engine core 1,017 -> 345 MiB peak); with TREADLE_PACKED_GGUF_WEIGHTS=1 the packed (or dense)
  method: 4 bytes a weight more (~520 MB for the default model, its LM head included) for a
  512-token prefill ~1.02-1.05x faster (1.15-1.2x against the blocks alone).

A layer with both the blocks and the packed copy frees its float32 weight: no call reads it.

oneDNN builds (and caches, up to 1024 per process) one primitive per input shape, ~250 KB each
of descriptors: a row count per prefill chunk grew a serving engine core by ~1.5 MB a second
under mixed load (issue 28). So oneDNN only ever sees few row counts (`onednn_rows`): multiples
of `ROW_BUCKET`, and below that multiples of 8 (padded); a GGUF layer sends the rows past the
last whole bucket to its blocks instead.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from treadle import envs
from treadle.logger import init_logger
from treadle.model import kernel_lib
from treadle.model.cpu_kernels import INT8_LINEAR, Kernels
from treadle.model.quantized import KIND_Q4_G16, QuantizedWeight

logger = init_logger(__name__)

PACKED_MIN_ROWS = 3  # below this, float32 stays on PyTorch's GEMV (faster at 1-2 rows)
ROW_BUCKET = 64  # oneDNN runs whole multiples of this many rows, and padded remainders
SMALL_ROW_STEP = 8  # a remainder (or a batch) below ROW_BUCKET is padded to a multiple of this
EXPAND_MIN_ROWS = 256  # from this many rows a layer kept only as blocks expands them for oneDNN
# The same for int8x2 on blocks laid out 16 wide, per ISA level: where its kernel stops being
# the faster. A layer's four linears (default model, 2 threads, an Intel Xeon, 2026-12-04),
# blocks against expansion: avx512vnni 0.79 at 256 rows, 0.93 at 512, 0.99 at 768, 1.07 at
# 1024; avx2vnni 0.80, 0.94, 0.96; avx2 0.94 at 256, 1.01 at 320, 1.16 at 1024; avx512 (512-bit
# maddubs: no more products a cycle than 256-bit on Intel) 1.09 at 256.
EXPAND_MIN_ROWS_INT8X2 = {"avx512vnni": 768, "avx512": 256, "avx2vnni": 768, "avx2": 320}
# On AMD's AVX-512 CPUs (Zen 4 and later) the blocks stay the faster at every row count: the
# team's 2-core AMD EPYC (/proc/cpuinfo: cpu family 26), 2 threads, a layer's four linears,
# blocks against expansion (2026-12-05, quiet): avx512vnni 0.79 at 512 rows, 0.82 at 768, 0.85
# at 1,024, 0.84 at 2,048; avx512 0.71 at 256, 0.85 at 512, 0.94 at 2,048; at the avx2 cap 0.79
# at 256, 0.84-0.87 at 512-2,048. There int8x2 never expands.
NEVER = 1 << 40

# Up to this many float32 rows the GGUF-block kernel is faster than oneDNN's packed float32
# GEMM (or PyTorch's GEMV at 1-2 rows), per ISA level: measured on the default model's shapes
# with `benchmarks/linear_crossover.py` (layers alone) and in the engine (decode steps of N
# running requests), side by side.
# - avx512 (2-core Zen 4): 1.9x at 1 row, 1.5x at 12, 1.2-1.3x at 24-32, 1.08x at 64, 1.03x
#   at 96 in the engine.
# - avx2 (the same CPU at TREADLE_CPU_ISA=avx2, oneDNN capped at AVX2 too): layers alone
#   2-3.8x at 1-2 rows, 0.9-1.06x from 4 to 128 rows; in the engine (64 prompts, offline) 64
#   rows on the blocks gave 263.5 output tok/s against 248.8 with the blocks up to 2 rows:
#   oneDNN streams 4x the bytes of the blocks, and every decode step stays fused.
# - portable: the plain-C expansion (no byte-widening instruction in baseline x86-64) is 2-3x
#   slower than oneDNN even at one row (0.53x for a layer's linears): never.
# - avx512vnni: the avx512 level's float32 code, so its crossover; avx2vnni: the avx2 level's.
GGUF_MAX_ROWS = {"avx512vnni": 64, "avx512": 64, "avx2vnni": 64, "avx2": 64, "portable": 0}


class LinearMethod:
    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class DenseLinear(LinearMethod):
    def __init__(self, weight: torch.Tensor, matmul: bool = False) -> None:
        self.weight = weight
        # matmul(x, W^T), not F.linear: for the LM head at one row on the CPU it is markedly
        # faster.
        self.matmul = matmul

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.matmul and bias is None:
            return torch.matmul(x, self.weight.t())
        return F.linear(x, self.weight, bias)


class PackedLinear(DenseLinear):
    def __init__(self, weight: torch.Tensor, packed: torch.Tensor, matmul: bool = False) -> None:
        super().__init__(weight, matmul)
        self.packed = packed
        self.min_rows = 0 if weight.dtype == torch.bfloat16 else PACKED_MIN_ROWS

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] < self.min_rows:
            return super().apply(x, bias)
        return onednn_bucketed(x, self.packed, bias)


def onednn_bucketed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T + b on oneDNN in whole buckets of ROW_BUCKET rows, and the remainder padded to a
    multiple of SMALL_ROW_STEP (`weight`: prepacked, or a plain `[out, in]` float32 one)."""
    rows = x.shape[0]
    x = x.contiguous()
    whole = rows - rows % ROW_BUCKET
    if whole == rows:
        return onednn_linear(x, weight, bias)
    if whole == 0:
        return _padded(x, weight, bias)
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
    out[:whole] = onednn_linear(x[:whole], weight, bias)
    out[whole:] = _padded(x[whole:], weight, bias)
    return out


def _padded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for fewer than ROW_BUCKET rows, padded to a multiple of SMALL_ROW_STEP."""
    rows = x.shape[0]
    padded = -(-rows // SMALL_ROW_STEP) * SMALL_ROW_STEP
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    return onednn_linear(x, weight, bias)[:rows]


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b on oneDNN's prepacked W (x contiguous)."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


class ExpandedLinear(LinearMethod):
    """A layer kept only as GGUF blocks, for products of `expand_min_rows` rows or more: the
    blocks expanded to float32 into a scratch buffer shared by every layer of the process (the
    largest layer's size: 7 MB for the default model), then oneDNN's GEMM on it
    (`onednn_bucketed`); fewer rows on the blocks' own kernel. A layer's four linears, side by
    side (avx512, 2 threads): 1.05x the packed copy's time at 512 and 1024 rows, where the
    blocks' kernel takes 1.3x and 1.7x; at 128 rows the blocks' kernel is the faster (1.07x
    against 1.17x)."""

    def __init__(self, kernels: Kernels, quant: QuantizedWeight) -> None:
        self.kernels = kernels
        self.quant = quant
        self.min_rows = expand_min_rows(kernels, quant)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q = self.quant
        if x.shape[0] < self.min_rows:
            return on_blocks(self.kernels, q, x, bias)
        weight = self.kernels.gguf_dequantize(
            q.tiles, q.kind, q.out_features, _scratch(q.out_features * q.in_features)
        )
        return onednn_bucketed(x, weight, bias)


def expand_min_rows(kernels: Kernels, quant: QuantizedWeight) -> int:
    """From how many rows `ExpandedLinear` expands this weight's blocks (`NEVER`: not at all)."""
    if quant.kind >= KIND_Q4_G16 and kernels.activations == "int8x2":
        if kernels.isa != "portable" and _amd_avx512():
            return NEVER
        return EXPAND_MIN_ROWS_INT8X2.get(kernels.isa, EXPAND_MIN_ROWS)
    return EXPAND_MIN_ROWS


@functools.cache
def _amd_avx512() -> bool:
    """Whether this CPU is one of AMD's with AVX-512 (Zen 4 and later)."""
    return kernel_lib.cpu_vendor() == "AuthenticAMD" and "avx512f" in kernel_lib.cpu_flags()


_SCRATCH = [torch.empty(0)]


def _scratch(numel: int) -> torch.Tensor:
    """This process's float32 scratch buffer for `ExpandedLinear`, of at least `numel`."""
    if _SCRATCH[0].numel() < numel:
        _SCRATCH[0] = torch.empty(numel)
    return _SCRATCH[0]


class GGUFLinear(LinearMethod):
    """The blocks up to `max_rows` rows, `beyond` past them; without `beyond`, the blocks for
    every row count (the kernel then expands each tile once and multiplies all rows by it)."""

    def __init__(
        self, kernels: Kernels, quant: QuantizedWeight, beyond: LinearMethod | None, max_rows: int
    ) -> None:
        self.kernels = kernels
        self.quant = quant
        self.beyond = beyond
        self.max_rows = max_rows

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.max_rows or self.beyond is None:
            return self._blocks(x, bias)
        # Whole buckets beyond (few shapes for oneDNN), the rest on the blocks, which are as
        # fast up to max_rows (>= ROW_BUCKET where the beyond method is oneDNN's).
        rest = rows % ROW_BUCKET if self.max_rows >= ROW_BUCKET else 0
        if rest == 0:
            return self.beyond.apply(x, bias)
        whole = rows - rest
        out = torch.empty(rows, self.quant.out_features, dtype=x.dtype, device=x.device)
        out[:whole] = self.beyond.apply(x[:whole], bias)
        out[whole:] = self._blocks(x[whole:], bias)
        return out

    def _blocks(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return on_blocks(self.kernels, self.quant, x, bias)


def on_blocks(
    kernels: Kernels, q: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T + b on the blocks' kernel."""
    out = kernels.gguf_linear(x, q.tiles, q.kind, q.out_features)
    return out if bias is None else out.add_(bias)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a `[out, in]` weight, or None where it does not apply."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not envs.cpu_kernels()
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError) as e:  # a build without these ops
        logger.info("oneDNN weight packing unavailable (%s); using F.linear", e)
        return None
    return packed


def on_blocks_only(quant: QuantizedWeight | None, kernels: Kernels | None) -> bool:
    """Whether `choose` puts a layer with these blocks on them alone (no float32 weight)."""
    return (
        quant is not None
        and kernels is not None
        and GGUF_MAX_ROWS[kernels.isa] >= 1
        and not envs.packed_gguf_weights()
    )


def for_activations(quant: QuantizedWeight, kernels: Kernels) -> QuantizedWeight:
    """The blocks as the kernels take them best: with int8 activations, laid out 16 outputs
    wide where this level runs that (`QuantizedWeight.to_g16`: ~3x less work per row than
    the tiles, so a speculative step's k + 1 rows cost little more than one; the same bytes,
    so the tiles are not kept); else as they are."""
    if kernels.activations in INT8_LINEAR and kernels.g16_kinds >> quant.kind & 1:
        return quant.to_g16(in_place=True)
    return quant


def choose(
    weight: torch.nn.Parameter,
    quant: QuantizedWeight | None,
    kernels: Kernels | None,
    lm_head: bool = False,
) -> LinearMethod:
    """The method for a loaded layer; frees `weight` (in place) where no call would read it.
    A layer with GGUF blocks that the kernels run takes them for every row count and keeps no
    float32 copy at all, unless TREADLE_PACKED_GGUF_WEIGHTS keeps oneDNN's packed copy for the
    rows past `GGUF_MAX_ROWS`; then the LM head's weight stays, as the (tied) embedding table.
    (A freed LM head weight: the embedding looks its rows up in the blocks instead.)"""
    max_rows = GGUF_MAX_ROWS[kernels.isa] if kernels is not None else 0
    on_blocks = quant is not None and kernels is not None and max_rows >= 1
    if on_blocks:
        assert quant is not None and kernels is not None
        quant = for_activations(quant, kernels)
    if on_blocks_only(quant, kernels):
        assert quant is not None and kernels is not None
        weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
        # The LM head's expansion would need a scratch of its whole size (113 MB for the
        # default model): its many-row products (prompt logprobs) stay on the blocks. So do
        # blocks laid out 16 wide for int8 activations: faster than oneDNN's float32 GEMM at
        # every row count (a layer's linears at 512 rows, avx512vnni, 2 threads: 6.2 ms
        # against 8.3 for the packed copy; the LM head 57 against 94). int8x2's two rows a
        # row are not: TTFT of a 512-token prompt 748 ms against float32's 645 at avx512vnni,
        # 1,334 against 860 at avx2 (an Intel Xeon, 2026-12-04), so its many-row products
        # expand the blocks too, from where that is the faster (`expand_min_rows`).
        expand = (
            not lm_head
            and torch.backends.mkldnn.is_available()
            and (quant.kind < KIND_Q4_G16 or kernels.activations == "int8x2")
        )
        beyond = ExpandedLinear(kernels, quant) if expand else None
        return GGUFLinear(kernels, quant, beyond, max_rows)
    packed = pack_weight(weight)
    dense = (
        DenseLinear(weight, lm_head) if packed is None else PackedLinear(weight, packed, lm_head)
    )
    if not on_blocks:
        return dense
    assert quant is not None and kernels is not None
    if packed is not None and max_rows >= PACKED_MIN_ROWS - 1 and not lm_head:
        # Every row count now goes to the blocks or to the packed copy.
        weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
    return GGUFLinear(kernels, quant, dense, max_rows)
