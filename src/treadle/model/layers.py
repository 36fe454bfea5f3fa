"""Building blocks of a Llama-family decoder; each parameter knows how to load its own shard."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from treadle.model import linear_method, quantized
from treadle.model.arch import UnsupportedModelError
from treadle.model.cpu_kernels import Kernels
from treadle.model.lora import LoRALayer
from treadle.model.parallel import all_gather_last_dim, all_reduce, tp_rank, tp_size


def _attach_loader(param: nn.Parameter, loader: Any) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    check_shape(param, loaded)
    param.data.copy_(quantized.values(loaded))


def check_shape(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _attach_loader(nn.Parameter(torch.ones(size)), default_weight_loader)
        self.kernels: Kernels | None = None

    def prepare(self, kernels: Kernels | None) -> None:
        """After loading: run on the C kernels (float32 on the CPU) or on PyTorch."""
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x) * weight; with `residual`, first `residual += x` (in place) and then
        the norm of the sum (the residual stream between sublayers)."""
        if self.kernels is not None and x.dim() == 2:  # rows of a step (not per-head norms)
            if residual is None:
                return self.kernels.rms_norm(x, self.weight, self.eps)
            return self.kernels.add_rms_norm(residual, x.contiguous(), self.weight, self.eps)
        if residual is not None:
            x = residual.add_(x)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b), output dim split across TP ranks; several checkpoint matrices may be
    packed side by side (`shard_sizes`: their full output sizes, e.g. gate and up)."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.in_features = in_features
        self.full_sizes = shard_sizes
        self.local_sizes = [s // self.tp_size for s in shard_sizes]
        self.weight = _attach_loader(
            nn.Parameter(torch.empty(sum(self.local_sizes), in_features)), self.weight_loader
        )
        self.bias = (
            _attach_loader(nn.Parameter(torch.zeros(sum(self.local_sizes))), self.weight_loader)
            if bias
            else None
        )
        self.method: linear_method.LinearMethod = linear_method.DenseLinear(self.weight)
        self._gguf_parts: dict[int, quantized.GGUFBlocks | None] = {}
        self.lora: LoRALayer | None = None  # adapters' updates (`model/lora.py`), if enabled

    def _shard_source(self, shard: int) -> tuple[int, int]:
        """(row offset in the checkpoint matrix, rows) that this rank holds for `shard`."""
        size = self.local_sizes[shard]
        return self.tp_rank * size, size

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None
    ) -> None:
        """Copies this rank's rows of `loaded`; from GGUF blocks, keeps the blocks instead."""
        shard = 0 if shard is None else shard
        dest_offset = sum(self.local_sizes[:shard])
        src_offset, size = self._shard_source(shard)
        blocks = quantized.blocks_of(loaded) if param is self.weight else None
        part = blocks.rows(src_offset, size) if blocks else None
        if param is self.weight:
            self._gguf_parts[shard] = part
        default_weight_loader_slice(param, loaded, dest_offset, src_offset, size, part is None)

    def prepare(self, kernels: Kernels | None) -> None:
        """After loading: choose how to multiply (linear_method.py); the weight gets the
        blocks' values only where the method reads the float32 weight."""
        parts = [self._gguf_parts.get(i) for i in range(len(self.local_sizes))]
        quant = quantized.QuantizedWeight.build(parts, self.weight.shape[0], self.weight.device)
        self._gguf_parts = {}
        if not linear_method.on_blocks_only(quant, kernels):
            for shard, part in enumerate(parts):
                if part is not None:
                    offset = sum(self.local_sizes[:shard])
                    _fill(self.weight.data.narrow(0, offset, self.local_sizes[shard]), part)
        self.method = linear_method.choose(self.weight, quant, kernels)

    def shard_sources(self) -> list[tuple[int, int]]:
        """Per packed shard, (first row, rows) of the full matrix that this rank holds."""
        return [self._shard_source(i) for i in range(len(self.local_sizes))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(x, self.bias)
        if self.lora is not None and self.lora.batch.rows:
            self.lora.add_delta(x, y)  # (y is this call's own tensor)
        return y


def default_weight_loader_slice(
    param: nn.Parameter,
    loaded: torch.Tensor,
    dest_offset: int,
    src_offset: int,
    size: int,
    copy: bool = True,
) -> None:
    """Rows [src_offset, + size) of `loaded` into rows [dest_offset, + size) of `param`;
    `copy=False`: only the shape check (the values stay in their GGUF blocks)."""
    src = loaded.narrow(0, src_offset, size)
    dest = param.data.narrow(0, dest_offset, size)
    if dest.shape != src.shape:
        raise ValueError(
            f"shape mismatch: parameter slice {tuple(dest.shape)}, checkpoint {tuple(src.shape)}"
        )
    if copy:
        dest.copy_(quantized.values(loaded).narrow(0, src_offset, size))


def _fill(dest: torch.Tensor, blocks: quantized.GGUFBlocks) -> None:
    """`dest` (a weight's rows) from the GGUF blocks its loader kept instead of copying."""
    dest.copy_(torch.from_numpy(blocks.dequantize()))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed into one matrix; KV heads are replicated across ranks when
    there are more ranks than KV heads."""

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        size = tp_size()
        self.num_kv_heads_full = num_kv_heads
        self.kv_replicas = max(1, size // num_kv_heads)
        local_kv = max(1, num_kv_heads // size)
        kv_full = local_kv * head_dim * size  # so that local_sizes gives local_kv heads per rank
        super().__init__(hidden, [num_heads * head_dim, kv_full, kv_full], bias)
        self.head_dim = head_dim

    def _shard_source(self, shard: int) -> tuple[int, int]:
        size = self.local_sizes[shard]
        if shard == 0:
            return self.tp_rank * size, size
        return (self.tp_rank // self.kv_replicas) * size, size


class RowParallelLinear(nn.Module):
    """y = x W^T with the input dim split across ranks, summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.out_features = out_features
        self.local_in = in_features // self.tp_size
        self.weight = _attach_loader(
            nn.Parameter(torch.empty(out_features, self.local_in)), self.weight_loader
        )
        self.bias = (
            _attach_loader(nn.Parameter(torch.zeros(out_features)), default_weight_loader)
            if bias
            else None
        )
        self.method: linear_method.LinearMethod = linear_method.DenseLinear(self.weight)
        self._gguf: quantized.GGUFBlocks | None = None
        self.lora: LoRALayer | None = None  # adapters' updates (`model/lora.py`), if enabled

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copies this rank's columns of `loaded`; from GGUF blocks (whole blocks of them),
        keeps the blocks instead."""
        start = self.tp_rank * self.local_in
        blocks = quantized.blocks_of(loaded)
        self._gguf = blocks.cols(start, self.local_in) if blocks else None
        src = loaded.narrow(1, start, self.local_in)
        if self._gguf is not None:
            check_shape(param, src)
        else:
            default_weight_loader(param, quantized.values(loaded).narrow(1, start, self.local_in))

    def prepare(self, kernels: Kernels | None) -> None:
        """After loading: choose how to multiply (linear_method.py); the weight gets the
        blocks' values only where the method reads the float32 weight."""
        quant = quantized.QuantizedWeight.build(
            [self._gguf], self.weight.shape[0], self.weight.device
        )
        if self._gguf is not None and not linear_method.on_blocks_only(quant, kernels):
            _fill(self.weight.data, self._gguf)
        self._gguf = None
        self.method = linear_method.choose(self.weight, quant, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.method.apply(x, None)
        if self.lora is not None and self.lora.batch.rows:
            self.lora.add_delta(x, partial)  # (x's shard) A's columns, summed by the reduce
        y = all_reduce(partial)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; also the (tied) LM head. A tied table whose
    LM head runs on its GGUF blocks keeps only the blocks: lookups dequantize their rows."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.local_vocab = math.ceil(vocab_size / self.tp_size)
        self.start = self.tp_rank * self.local_vocab
        self.weight = _attach_loader(
            nn.Parameter(torch.empty(self.local_vocab, hidden)), self.weight_loader
        )
        self.method: linear_method.LinearMethod = linear_method.DenseLinear(self.weight, True)
        self._gguf: quantized.GGUFBlocks | None = None
        self._rows_from: quantized.QuantizedWeight | None = None  # where `weight` was freed
        self._rows_kernels: Kernels | None = None  # (the C lookup of `_rows_from`'s rows)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copies this rank's rows of `loaded`; from GGUF blocks, keeps the blocks instead."""
        rows = min(self.local_vocab, self.vocab_size - self.start)
        blocks = quantized.blocks_of(loaded)
        self._gguf = blocks.rows(self.start, rows) if blocks else None
        src = loaded.narrow(0, self.start, rows)
        check_shape(param.data[:rows], src)
        param.data[rows:].zero_()  # the padding of the last rank's share
        if self._gguf is None:
            param.data[:rows].copy_(src)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        out = self._lookup(local.masked_fill(outside, 0))
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self._rows_from is None:
            return F.embedding(ids, self.weight)
        q, kernels = self._rows_from, self._rows_kernels
        rows = (
            kernels.gguf_rows(q.tiles, q.kind, q.out_features, ids)
            if kernels is not None
            else q.dequantize_rows(ids)
        )
        return rows.view(*ids.shape, rows.shape[-1])

    def drop_gguf_blocks(self) -> None:
        """The table in float32 from the loaded blocks, which it then forgets (an embedding
        table that is not also the LM head: looked up by rows only)."""
        if self._gguf is not None:
            _fill(self.weight.data[: self._gguf.raw.shape[0]], self._gguf)
        self._gguf = None

    def keep_for_lookup(self, kernels: Kernels | None) -> None:
        """A tied table on a pipeline stage without the LM head: looked up as the whole
        model's is (from the GGUF blocks, where the LM head would run on them)."""
        if self._gguf is not None:
            self.prepare_lm_head(kernels)

    def prepare_lm_head(self, kernels: Kernels | None) -> None:
        """After loading, where this is the LM head: choose how `logits` multiplies; where
        that frees `weight` (the LM head on its blocks), lookups read the blocks."""
        quant = quantized.QuantizedWeight.build([self._gguf], self.local_vocab, self.weight.device)
        if self._gguf is not None and not linear_method.on_blocks_only(quant, kernels):
            _fill(self.weight.data[: self._gguf.raw.shape[0]], self._gguf)
        self._gguf = None
        self.method = linear_method.choose(self.weight, quant, kernels, lm_head=True)
        if self.weight.numel() == 0:
            # (the method's copy: `choose` may have laid the blocks out anew)
            self._rows_from = getattr(self.method, "quant", quant)
            self._rows_kernels = kernels

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.method.apply(hidden, None)
        return all_gather_last_dim(local)[..., : self.vocab_size]


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE with cos/sin precomputed in float32 for every position."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (
            base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        inv_freq = _scale_inv_freq(inv_freq, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos and sin, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(
            1
        )


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: Kernels | None
) -> torch.Tensor:
    """x [T, H, d] (heads contiguous) rotated; in place on the C kernels (x itself returned)."""
    if kernels is not None:
        kernels.rope_(x, cos, sin)
        return x
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any] | None) -> torch.Tensor:
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedModelError(
        f"unsupported rope scaling type {kind!r}; treadle supports linear and llama3"
    )
