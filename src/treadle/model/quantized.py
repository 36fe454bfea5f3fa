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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from treadle.model.gguf_file import dequantize_blocks

BLOCK = 32  # weights per GGUF block (Q4_0, Q4_1, Q8_0)
TILE_N = 4  # output rows stored side by side (the kernel's TILE_N)
KIND_Q4, KIND_Q8 = 0, 1  # the kernel's block kinds
KIND_Q4_G16, KIND_Q8_G16 = 2, 3  # the same laid out 16 outputs wide (`QuantizedWeight.to_g16`)
G16 = 16
_BUILD_ROWS = 4096  # rows laid out at a time (`QuantizedWeight.build`)
# GGUF type -> (bytes per block, kernel kind)
_RAW = {"Q4_0": (18, KIND_Q4), "Q4_1": (20, KIND_Q4), "Q8_0": (34, KIND_Q8)}


@dataclass(frozen=True)
class GGUFBlocks:
    """A 2-D GGUF weight's blocks as stored: `raw[n]` holds output row n's K/32 blocks."""

    kind: str  # GGUF type name
    raw: np.ndarray  # uint8 [N, K / 32 * bytes per block]
    # Called once rows of `raw` are copied out: unmaps the file's pages (`GGUFFile`).
    release: Callable[[], None] | None = field(default=None, compare=False)

    def rows(self, start: int, size: int) -> GGUFBlocks:
        return GGUFBlocks(self.kind, self.raw[start : start + size], self.release)

    def dequantize(self) -> np.ndarray:
        """float32 `[rows, K]`: gguf's formulas (`gguf_file.dequantize_blocks`)."""
        raw = np.ascontiguousarray(self.raw)
        return dequantize_blocks(self.kind, raw.reshape(-1)).reshape(raw.shape[0], -1)

    def cols(self, start: int, size: int) -> GGUFBlocks | None:
        """Inputs [start, start + size), or None unless both fall on block boundaries."""
        if start % BLOCK or size % BLOCK:
            return None
        nbytes = _RAW[self.kind][0]
        return GGUFBlocks(
            self.kind,
            self.raw[:, start // BLOCK * nbytes : (start + size) // BLOCK * nbytes],
            self.release,
        )


def kernel_type(kind: str) -> bool:
    """Whether the kernel reads this GGUF type."""
    return kind in _RAW


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
        nbytes, kernel_kind = _RAW[kind]
        rows = sum(p.raw.shape[0] for p in parts if p is not None)
        nb = parts[0].raw.shape[1] // nbytes  # type: ignore[union-attr]
        if rows > out_features:
            return None
        width = 20 if kernel_kind == KIND_Q4 else 34
        # Written in place, a part at a time: row r goes to tile r // TILE_N, slot r % TILE_N.
        tiles = np.zeros((-(-out_features // TILE_N), nb, TILE_N, width), dtype=np.uint8)
        start = 0
        for part in parts:
            assert part is not None
            # A few MB at a time, so that the file's pages go as their copies come.
            for lo in range(0, part.raw.shape[0], _BUILD_ROWS):
                blocks = part.raw[lo : lo + _BUILD_ROWS].reshape(-1, nb, nbytes)
                if kind == "Q4_0":  # d (q - 8) = d q + m with m = -8 d, exact in half precision
                    d = blocks[..., 0:2].copy().view(np.float16)
                    m = (d * np.float16(-8)).view(np.uint8)
                    blocks = np.concatenate([blocks[..., 0:2], m, blocks[..., 2:]], axis=-1)
                # else Q4_1 (d, m, qs) and Q8_0 (d, qs) are the kernel's layout already
                r = np.arange(start, start + blocks.shape[0])
                tiles[r // TILE_N, :, r % TILE_N] = blocks
                start += blocks.shape[0]
                if part.release is not None:
                    part.release()
        return cls(torch.from_numpy(tiles), kernel_kind, out_features, nb * BLOCK)

    def to_g16(self, in_place: bool = False) -> QuantizedWeight:
        """The same blocks laid out 16 outputs wide, for int8 activations (`csrc/common.h`:
        per group of 16 outputs and block, the 16 scales (and minimums), then the quants with
        one output's 4 consecutive inputs in each 32-bit lane; Q8's as q + 128). The tiles
        `[ceil(N / 4), K / 32, 4, bytes]` become `[ceil(N / 16), K / 32, 320 or 544]`: a
        group's bytes are its 4 tiles' bytes, rearranged. `in_place`: where N is a whole
        number of groups, in this weight's own memory, which then holds only the new layout
        (a load's blocks: no second copy of them, even for a moment)."""
        if self.kind not in (KIND_Q4, KIND_Q8):
            raise ValueError(f"block kind {self.kind} is not tiled")
        t = self.tiles
        ntiles, nb, _, width = t.shape
        per = G16 // TILE_N  # tiles a group
        groups = -(-ntiles // per)
        group_bytes = 320 if self.kind == KIND_Q4 else 544
        in_place = in_place and groups * per == ntiles and t.is_contiguous()
        packed = (
            t.view(groups, nb, group_bytes) if in_place else t.new_empty(groups, nb, group_bytes)
        )
        # A few groups at a time (~1 MiB): a whole LM head's copies (30 MB for the default
        # model, one per step below) had raised the load's peak RSS by ~90 MiB.
        step = max(1, (1 << 20) // (nb * group_bytes))
        for g0 in range(0, groups, step):
            n = min(step, groups - g0)
            chunk = t[g0 * per : (g0 + n) * per]
            if chunk.shape[0] != n * per:  # zero blocks up to a whole group
                pad = chunk.new_zeros(n * per - chunk.shape[0], nb, TILE_N, width)
                chunk = torch.cat([chunk, pad])
            elif in_place:
                chunk = chunk.clone()  # (its memory is about to be written)
            # output o = 4 * (its tile in the group) + its slot in the tile
            a = chunk.view(n, per, nb, TILE_N, width).permute(0, 2, 1, 3, 4)
            a = a.reshape(n, nb, G16, width)
            out = packed[g0 : g0 + n]
            out[..., 0:32] = a[..., 0:2].reshape(n, nb, 2 * G16)
            if self.kind == KIND_Q4:
                out[..., 32:64] = a[..., 2:4].reshape(n, nb, 2 * G16)
                qs = a[..., 4:20].reshape(n, nb, G16, 4, 4).permute(0, 1, 3, 2, 4)
                out[..., 64:] = qs.reshape(n, nb, 256)
            else:
                q = a[..., 2:34].reshape(n, nb, G16, 8, 4).permute(0, 1, 3, 2, 4)
                out[..., 32:] = q.reshape(n, nb, 512) ^ 0x80
        if in_place:  # this weight no longer holds tiles: any later use of it fails at once
            object.__setattr__(self, "tiles", t.new_empty(0, nb, TILE_N, width))
        return QuantizedWeight(packed, self.kind + KIND_Q4_G16, self.out_features, self.in_features)

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
