"""`LoRALayer` (model/lora.py): a step's update of rows of several adapters and of the base
model, on the C kernel (`lora_apply_sharded`: B^T in tiles, float32 or bfloat16 slots) and on
the batched products, against each row's own `(x A^T) B^T` shard by shard."""

from __future__ import annotations

import pytest
import torch

from treadle.model import cpu_kernels
from treadle.model.lora import LoRABatch, LoRALayer, SlotWeights

ENDS = [40, 56, 72]  # a packed layer of 3 shards (q, k, v) with 72 outputs: tiles of 64 + 8
RANK, IN = 8, 48


def adapter(seed: int, ranks: list[int | None]) -> SlotWeights:
    """Random A and B for the shards whose rank is given (None: not targeted)."""
    g = torch.Generator().manual_seed(seed)
    pieces = []
    for shard, r in enumerate(ranks):
        if r is not None:
            size = ENDS[shard] - (ENDS[shard - 1] if shard else 0)
            pieces.append(
                (shard, torch.randn(r, IN, generator=g), torch.randn(size, r, generator=g))
            )
    return SlotWeights(pieces, ENDS, 0.5 + seed)


def expected(x: torch.Tensor, rows: list[int], shares: dict[int, SlotWeights]) -> torch.Tensor:
    out = torch.zeros(x.shape[0], ENDS[-1], dtype=torch.float64)
    for r, slot in enumerate(rows):
        if slot < 0:
            continue
        share = shares[slot]
        for shard, a, b in share.pieces:
            first = ENDS[shard - 1] if shard else 0
            h = x[r].double() @ a.double().t()
            out[r, first : first + b.shape[0]] += share.scale * (h @ b.double().t())
    return out


KINDS = {"float32": (None, 1e-5), "bfloat16": (torch.bfloat16, 2e-2), "int8": (torch.int8, 2e-2)}
"""The slots' dtype, and the error allowed against float64 (of the largest update)."""


@pytest.mark.parametrize(
    ("isa", "kind"),
    [(isa, kind) for isa in cpu_kernels.available_isas() for kind in KINDS] + [(None, "float32")],
)
def test_each_row_gets_its_own_adapters_update(isa: str | None, kind: str) -> None:
    """Every ISA level's build of the kernel (the portable one too); None: batched products."""
    kernels = None if isa is None else cpu_kernels.kernels_for(isa)
    batch = LoRABatch(3, kernels)
    layer = LoRALayer(batch, 3 * RANK, IN, ENDS[-1], torch.float32, torch.device("cpu"))
    dtype, tolerance = KINDS[kind]
    layer.allocate(ENDS, dtype)
    assert layer.tiled == (kernels is not None)
    shares = {0: adapter(1, [8, 4, None]), 2: adapter(2, [None, 8, 8]), 1: adapter(3, [2, 2, 2])}
    for slot, share in shares.items():
        layer.set_slot(slot, share)
    rows = [2, -1, 0, 0, 1, 2, -1, 2, 0]  # the base model's rows (-1) get nothing
    x = torch.randn(len(rows), IN)
    slot_of_row = torch.tensor(rows, dtype=torch.long)
    if kernels is not None:
        batch.set_rows(slot_of_row)
    else:
        batch.set([(s, (slot_of_row == s).nonzero().flatten()) for s in (0, 1, 2)], len(rows))

    def check(rows: list[int]) -> None:
        base = torch.randn(len(rows), ENDS[-1])
        out = base.clone()
        layer.add_delta(x, out)
        delta = expected(x, rows, shares)
        error = (out.double() - base.double() - delta).abs().max()
        assert error <= tolerance * delta.abs().max(), (error, delta.abs().max())

    check(rows)
    # an emptied slot adds nothing any more; the others are untouched
    layer.set_slot(1, None)
    del shares[1]
    check([s if s in shares else -1 for s in rows])
