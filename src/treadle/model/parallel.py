"""Tensor-parallel state of this process: rank, size and the collectives the layers call.

With one rank (the default) every collective is the identity, so the model code is the same
for TP 1 and TP N; the worker calls `init_tensor_parallel` before it builds the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_rank = 0
_size = 1


def init_tensor_parallel(rank: int, size: int) -> None:
    """Record this process's TP coordinates (the process group itself is torch's default)."""
    global _rank, _size
    _rank, _size = rank, size


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
