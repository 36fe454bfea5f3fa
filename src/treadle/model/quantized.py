"""GGUF-quantized copies of linear weights, for the few-row products of decode steps on the CPU.

A decode step of one or a few requests is bound by reading the weights: in float32 the default
model's 135M weights are 540 MB per token. GGUF files already hold most of them as Q4_0/Q4_1
(0.56-0.63 bytes a weight) or Q8_0 (1.06). Where a linear layer's weight came from such blocks,
the layer keeps them beside its float32 weight, rearranged for the C kernel
(`csrc/cpu_kernels.c`, `gguf_linear_f32`), which expands each block to float32 in registers and
multiplies in float32: the same weights, read at a fifth of the bytes. Products of many rows
(prefill) are bound by arithmetic instead and go to oneDNN's GEMM (`linear_method.py` says
where the line falls). With int8 activations (`--cpu-activation-dtype int8`) the blocks are
laid out 16 outputs wide instead (`QuantizedWeight.to_g16`) and take every row count.

Flow: for a tensor in such blocks the GGUF loader yields a tensor that carries only its
blocks (`blocks_only`: a meta tensor of the weight's shape, so that no float32 copy is made
while loading); a layer's weight loader takes the rows or columns of its own shard (`blocks_of`,
`GGUFBlocks.rows/cols`), or the float32 values where its shard is no whole blocks (`values`);
after loading, `QuantizedWeight.build` lays them out for the kernel, and
`linear_method.GGUFLinear` calls it. A layer whose method needs float32 after all (no C
kernels, another device) dequantizes its blocks into its weight then (`GGUFBlocks.dequantize`).
The layouts themselves are `gguf_layout.py`'s, numpy only; here they become tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treadle.model.gguf_layout import (
    BLOCK,
    G16,
    KIND_Q4,
    KIND_Q4_G16,
    KIND_Q8,
    KIND_Q8_G16,
    TILE_N,
    GGUFBlocks,
    g16_layout,
    kernel_type,
    tile_layout,
)

__all__ = [
    "BLOCK",
    "G16",
    "KIND_Q4",
    "KIND_Q4_G16",
    "KIND_Q8",
    "KIND_Q8_G16",
    "TILE_N",
    "GGUFBlocks",
    "QuantizedWeight",
    "blocks_of",
    "blocks_only",
    "kernel_type",
    "values",
]


def blocks_only(shape: tuple[int, ...], blocks: GGUFBlocks) -> torch.Tensor:
    """A loaded float32 tensor of `shape` that carries only its blocks: a meta tensor (no
    storage; copying from it raises), its values from `values`."""
    tensor = torch.empty(shape, dtype=torch.float32, device="meta")
    tensor.gguf_blocks = blocks  # type: ignore[attr-defined]
    return tensor


def blocks_of(tensor: torch.Tensor) -> GGUFBlocks | None:
    return getattr(tensor, "gguf_blocks", None)


def values(tensor: torch.Tensor) -> torch.Tensor:
    """A loaded tensor's float32 values: itself, or its blocks dequantized (`blocks_only`)."""
    blocks = blocks_of(tensor)
    if tensor.device.type != "meta" or blocks is None:
        return tensor
    return torch.from_numpy(blocks.dequantize()).view(tensor.shape)


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight `[N, K]` in the kernel's tiled layout (`csrc/common.h`), or 16 wide."""

    # uint8, [ceil(N / TILE_N), K / 32, TILE_N, 20 (Q4) or 34 (Q8) bytes]; 16 wide (kinds
    # KIND_Q4_G16, KIND_Q8_G16): [ceil(N / 16), K / 32, 320 or 544 bytes]
    tiles: torch.Tensor
    kind: int
    out_features: int
    in_features: int

    @classmethod
    def build(
        cls, parts: list[GGUFBlocks | None], out_features: int, device: torch.device
    ) -> QuantizedWeight | None:
        """The parts' rows stacked (zero rows up to `out_features`), or None where the kernel
        does not apply: not on the CPU, or what `gguf_layout.tile_layout` refuses."""
        if device.type != "cpu":
            return None
        laid = tile_layout(parts, out_features)
        if laid is None:
            return None
        tiles, kernel_kind, in_features = laid
        return cls(torch.from_numpy(tiles), kernel_kind, out_features, in_features)

    def to_g16(self, in_place: bool = False) -> QuantizedWeight:
        """The same blocks laid out 16 outputs wide, for int8 activations
        (`gguf_layout.g16_layout`). `in_place`: where N is a whole number of groups, in this
        weight's own memory, which then holds only the new layout (a load's blocks: no second
        copy of them, even for a moment)."""
        t = self.tiles
        _, nb, _, width = t.shape
        packed = g16_layout(t.numpy(), self.kind, in_place)
        if in_place and np.may_share_memory(packed, t.numpy()):
            # this weight no longer holds tiles: any later use of it fails at once
            object.__setattr__(self, "tiles", t.new_empty(0, nb, TILE_N, width))
        return QuantizedWeight(
            torch.from_numpy(packed), self.kind + KIND_Q4_G16, self.out_features, self.in_features
        )

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in float32, `[len(ids), K]`: the same values as gguf's
        dequantization (d q, or d q + m: each product and sum rounded as numpy rounds them),
        for an embedding table kept only as blocks."""
        ids = ids.reshape(-1).to(torch.long)
        if self.kind >= KIND_Q4_G16:
            return self._dequantize_g16_rows(ids)
        blocks = self.tiles[ids // TILE_N, :, ids % TILE_N]  # [T, K / 32, bytes]
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()
        if self.kind == KIND_Q8:
            q = blocks[..., 2:].contiguous().view(torch.int8).float()
            return (d * q).reshape(len(ids), self.in_features)
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        qs = blocks[..., 4:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # weights i, i + 16 of each block
        return (d * q + m).reshape(len(ids), self.in_features)

    def _dequantize_g16_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """`dequantize_rows` of a weight laid out 16 wide: the same values."""
        n, at = len(ids), torch.arange(len(ids))
        o = ids % G16
        blocks = self.tiles[ids // G16]  # [T, K / 32, bytes]
        nb = blocks.shape[1]
        d = blocks[..., 0:32].reshape(n, nb, G16, 2)[at, :, o].contiguous()
        d = d.view(torch.float16).float()  # [T, K / 32, 1]
        if self.kind == KIND_Q8_G16:
            u = blocks[..., 32:].reshape(n, nb, 8, G16, 4)[at, :, :, o].reshape(n, nb, 32)
            q = (u.to(torch.int16) - 128).float()
            return (d * q).reshape(n, self.in_features)
        m = blocks[..., 32:64].reshape(n, nb, G16, 2)[at, :, o].contiguous()
        m = m.view(torch.float16).float()
        qs = blocks[..., 64:].reshape(n, nb, 4, G16, 4)[at, :, :, o].reshape(n, nb, 16)
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
        return (d * q + m).reshape(n, self.in_features)
