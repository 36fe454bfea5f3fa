"""GGUF-quantized copies of linear weights, for the few-row products of decode steps on the CPU.

A decode step of one or a few requests is bound by reading the weights: in float32 the default
model's 135M weights are 540 MB per token. GGUF files already hold most of them as Q4_0/Q4_1
(0.56-0.63 bytes a weight) or Q8_0 (1.06). Where a linear layer's weight came from such blocks,
the layer keeps them beside its float32 weight, rearranged for the C kernel
(`csrc/cpu_kernels.c`, `gguf_linear_f32`), which expands each block to float32 in registers and
multiplies in float32: the same weights, read at a fifth of the bytes. Products of many rows
(prefill) are bound by arithmetic instead and go to oneDNN's GEMM (`linear_method.py` says
where the line falls).

Flow: the GGUF loader attaches each tensor's raw blocks to the dequantized tensor it yields
(`attach`); a layer's weight loader takes the rows or columns of its own shard (`blocks_of`,
`GGUFBlocks.rows/cols`); after loading, `QuantizedWeight.build` lays them out for the kernel,
and `linear_method.GGUFLinear` calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights per GGUF block (Q4_0, Q4_1, Q8_0)
TILE_N = 4  # output rows stored side by side (the kernel's TILE_N)
KIND_Q4, KIND_Q8 = 0, 1  # the kernel's block kinds
# GGUF type -> (bytes per block, kernel kind)
_RAW = {"Q4_0": (18, KIND_Q4), "Q4_1": (20, KIND_Q4), "Q8_0": (34, KIND_Q8)}


@dataclass(frozen=True)
class GGUFBlocks:
    """A 2-D GGUF weight's blocks as stored: `raw[n]` holds output row n's K/32 blocks."""

    kind: str  # GGUF type name
    raw: np.ndarray  # uint8 [N, K / 32 * bytes per block]

    def rows(self, start: int, size: int) -> GGUFBlocks:
        return GGUFBlocks(self.kind, self.raw[start : start + size])

    def cols(self, start: int, size: int) -> GGUFBlocks | None:
        """Inputs [start, start + size), or None unless both fall on block boundaries."""
        if start % BLOCK or size % BLOCK:
            return None
        nbytes = _RAW[self.kind][0]
        return GGUFBlocks(
            self.kind, self.raw[:, start // BLOCK * nbytes : (start + size) // BLOCK * nbytes]
        )


def kernel_type(kind: str) -> bool:
    """Whether the kernel reads this GGUF type."""
    return kind in _RAW


def attach(tensor: torch.Tensor, blocks: GGUFBlocks) -> torch.Tensor:
    tensor.gguf_blocks = blocks  # type: ignore[attr-defined]
    return tensor


def blocks_of(tensor: torch.Tensor) -> GGUFBlocks | None:
    return getattr(tensor, "gguf_blocks", None)


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight `[N, K]` in the kernel's tiled layout (see `csrc/cpu_kernels.c`)."""

    tiles: torch.Tensor  # uint8, [ceil(N / TILE_N), K / 32, TILE_N, 20 (Q4) or 34 (Q8) bytes]
    kind: int
    out_features: int
    in_features: int

    @classmethod
    def build(
        cls, parts: list[GGUFBlocks | None], out_features: int, device: torch.device
    ) -> QuantizedWeight | None:
        """The parts' rows stacked (zero rows up to `out_features`), or None where the kernel
        does not apply: a part missing or of another type, not on the CPU."""
        if (
            device.type != "cpu"
            or not parts
            or any(p is None or not kernel_type(p.kind) for p in parts)
        ):
            return None
        kinds = {p.kind for p in parts if p is not None}
        if len(kinds) != 1:
            return None
        kind = kinds.pop()
        raw = np.concatenate([p.raw for p in parts if p is not None])
        nbytes, kernel_kind = _RAW[kind]
        rows, nb = raw.shape[0], raw.shape[1] // nbytes
        if rows > out_features:
            return None
        blocks = raw.reshape(rows, nb, nbytes)
        if kind == "Q4_0":  # d (q - 8) = d q + m with m = -8 d, exact in half precision
            d = blocks[..., 0:2].copy().view(np.float16)
            m = (d * np.float16(-8)).view(np.uint8)
            blocks = np.concatenate([blocks[..., 0:2], m, blocks[..., 2:]], axis=-1)
        # else Q4_1 (d, m, qs) and Q8_0 (d, qs) are the kernel's layout already
        padded = -(-out_features // TILE_N) * TILE_N
        width = blocks.shape[-1]
        out = np.zeros((padded, nb, width), dtype=np.uint8)
        out[:rows] = blocks
        tiles = out.reshape(padded // TILE_N, TILE_N, nb, width).transpose(0, 2, 1, 3)
        return cls(
            torch.from_numpy(np.ascontiguousarray(tiles)), kernel_kind, out_features, nb * BLOCK
        )
