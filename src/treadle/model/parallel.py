"""Tensor- and pipeline-parallel state of this process: ranks, sizes and the collectives the
layers call.

With one rank (the default) every collective is the identity, so the model code is the same
for TP 1 and TP N; the worker calls `init_parallel` before it builds the model. Ranks are
ordered as vLLM's: global rank = pp_rank * tp_size + tp_rank, so a stage's TP ranks are
consecutive; with several stages each stage's TP collectives run on a group of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_rank = 0
_size = 1
_pp_rank = 0
_pp_size = 1
_group: dist.ProcessGroup | None = None  # this stage's TP ranks (None: the default group)


def init_tensor_parallel(rank: int, size: int) -> None:
    """Record this process's TP coordinates (the process group itself is torch's default)."""
    init_parallel(rank, size)


def init_parallel(
    tp_rank_: int, tp_size_: int, pp_rank_: int = 0, pp_size_: int = 1, make_groups: bool = False
) -> None:
    """Record this process's coordinates; `make_groups` (every rank of the world calls it, in
    the same order, after `dist.init_process_group`) makes one TP group per pipeline stage."""
    global _rank, _size, _pp_rank, _pp_size, _group
    _rank, _size, _pp_rank, _pp_size, _group = tp_rank_, tp_size_, pp_rank_, pp_size_, None
    if make_groups and pp_size_ > 1 and tp_size_ > 1:
        for stage in range(pp_size_):
            group = dist.new_group(list(range(stage * tp_size_, (stage + 1) * tp_size_)))
            if stage == pp_rank_:
                _group = group


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def pp_rank() -> int:
    return _pp_rank


def pp_size() -> int:
    return _pp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _size > 1:
        dist.all_reduce(x, group=_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous(), group=_group)
    return torch.cat(parts, dim=-1)
