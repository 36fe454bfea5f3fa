"""GGUF blocks laid out for treadle's C kernels, with numpy only (`quantized.py` wraps the
arrays as tensors; a process without torch uses them as they are, docs/design/
torch-free-engine-core.md).

Two layouts (`csrc/common.h`):
- tiled: `[ceil(N / TILE_N), K / 32, TILE_N, 20 (Q4) or 34 (Q8) bytes]`, output row r in tile
  r // TILE_N, slot r % TILE_N; a block as the file holds it (Q4_0's d (q - 8) written as
  Q4_1's d q + m with m = -8 d, exact in half precision);
- 16 wide (`g16_layout`), for int8 activations: `[ceil(N / 16), K / 32, 320 or 544]`, per
  group of 16 outputs and block the 16 scales (and minimums), then the quants with one
  output's 4 consecutive inputs in each 32-bit lane (Q8's as q + 128).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from treadle.model.gguf_file import dequantize_blocks

BLOCK = 32  # weights per GGUF block (Q4_0, Q4_1, Q8_0)
TILE_N = 4  # output rows stored side by side (the kernel's TILE_N)
KIND_Q4, KIND_Q8 = 0, 1  # the kernel's block kinds
KIND_Q4_G16, KIND_Q8_G16 = 2, 3  # the same laid out 16 outputs wide (`g16_layout`)
G16 = 16
_BUILD_ROWS = 4096  # rows laid out at a time (`tile_layout`)
# GGUF type -> (bytes per block, kernel kind)
RAW = {"Q4_0": (18, KIND_Q4), "Q4_1": (20, KIND_Q4), "Q8_0": (34, KIND_Q8)}


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
        nbytes = RAW[self.kind][0]
        return GGUFBlocks(
            self.kind,
            self.raw[:, start // BLOCK * nbytes : (start + size) // BLOCK * nbytes],
            self.release,
        )


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its RoPE; restore Hugging Face's half split."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def kernel_type(kind: str) -> bool:
    """Whether the kernel reads this GGUF type."""
    return kind in RAW


def tile_layout(
    parts: list[GGUFBlocks | None], out_features: int
) -> tuple[np.ndarray, int, int] | None:
    """(tiles, kernel kind, in_features) of the parts' rows stacked, zero rows up to
    `out_features`; None where a part is missing, of a type the kernel does not read, of
    another type than the others, or there are more rows than `out_features`. Each part's
    `release` is called as its rows are copied (a few MB at a time, so that the file's pages
    go as their copies come)."""
    if not parts or any(p is None or not kernel_type(p.kind) for p in parts):
        return None
    kinds = {p.kind for p in parts if p is not None}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    nbytes, kernel_kind = RAW[kind]
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
    return tiles, kernel_kind, nb * BLOCK


def g16_layout(tiles: np.ndarray, kind: int, in_place: bool = False) -> np.ndarray:
    """Tiles `[ceil(N / 4), K / 32, 4, bytes]` of `kind` (KIND_Q4 or KIND_Q8) laid out 16
    outputs wide, `[ceil(N / 16), K / 32, 320 or 544]`: a group's bytes are its 4 tiles'
    bytes, rearranged. `in_place`: where N is a whole number of groups and `tiles` is
    contiguous, in the tiles' own memory, which then holds only the new layout (a load's
    blocks: no second copy of them, even for a moment); the caller must not read `tiles` as
    tiles again."""
    if kind not in (KIND_Q4, KIND_Q8):
        raise ValueError(f"block kind {kind} is not tiled")
    ntiles, nb, _, width = tiles.shape
    per = G16 // TILE_N  # tiles a group
    groups = -(-ntiles // per)
    group_bytes = 320 if kind == KIND_Q4 else 544
    in_place = in_place and groups * per == ntiles and tiles.flags.c_contiguous
    packed = (
        tiles.reshape(groups, nb, group_bytes)
        if in_place
        else np.empty((groups, nb, group_bytes), np.uint8)
    )
    # A few groups at a time (~1 MiB): a whole LM head's copies (30 MB for the default model,
    # one per step below) had raised the load's peak RSS by ~90 MiB.
    step = max(1, (1 << 20) // (nb * group_bytes))
    for g0 in range(0, groups, step):
        n = min(step, groups - g0)
        chunk = tiles[g0 * per : (g0 + n) * per]
        if chunk.shape[0] != n * per:  # zero blocks up to a whole group
            pad = np.zeros((n * per - chunk.shape[0], nb, TILE_N, width), np.uint8)
            chunk = np.concatenate([chunk, pad])
        elif in_place:
            chunk = chunk.copy()  # (its memory is about to be written)
        # output o = 4 * (its tile in the group) + its slot in the tile
        a = chunk.reshape(n, per, nb, TILE_N, width).transpose(0, 2, 1, 3, 4)
        a = a.reshape(n, nb, G16, width)
        out = packed[g0 : g0 + n]
        out[..., 0:32] = a[..., 0:2].reshape(n, nb, 2 * G16)
        if kind == KIND_Q4:
            out[..., 32:64] = a[..., 2:4].reshape(n, nb, 2 * G16)
            qs = a[..., 4:20].reshape(n, nb, G16, 4, 4).transpose(0, 1, 3, 2, 4)
            out[..., 64:] = qs.reshape(n, nb, 256)
        else:
            q = a[..., 2:34].reshape(n, nb, G16, 8, 4).transpose(0, 1, 3, 2, 4)
            out[..., 32:] = q.reshape(n, nb, 512) ^ 0x80
    return packed
