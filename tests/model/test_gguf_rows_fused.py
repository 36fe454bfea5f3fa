"""A whole fused decode step of the default model gives each row the logits that row gets in a
step of its own, to the bit, at every ISA level with a fused path (at avx2, one of 3 rows: its
1- and 2-row steps take a faster sum of other bits): the rows of a batch, or the
k + 1 rows a speculative step verifies, do not move each other's logits (so greedy outputs do
not depend on how many rows a step had)."""

from __future__ import annotations

import pytest
import torch

from treadle.config import resolve_model
from treadle.model import cpu_kernels, linear_method
from treadle.model.attention import AttentionMetadata
from treadle.model.loader import load_model, read_arch

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None,
    reason="no C compiler here (or TREADLE_CPU_KERNELS=0): the kernels cannot be built",
)


SUM_WAY_ISAS = {"avx2", "avx2vnni"}  # 1 and 2 rows the sum way (`csrc/avx2.h`, SUM_MAX_ROWS)
BLOCK_SIZE, BLOCKS_EACH = 16, 16  # request i owns blocks 16 i .. 16 i + 15 of the cache


def decode_step(model, requests: list[tuple[int, int]], kv_caches) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """One decode token for each (request index, context length incl. the new token), each
    request on its own blocks (scattered: reversed), the same wherever it sits in the step."""
    table = torch.tensor(
        [[i * BLOCKS_EACH + BLOCKS_EACH - 1 - j for j in range(BLOCKS_EACH)] for i, _ in requests]
    )
    lengths = [n for _, n in requests]
    slots = [int(table[r, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
             for r, n in enumerate(lengths)]  # fmt: skip
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=len(lengths),
        decode_block_table=table,
        decode_lens=torch.tensor(lengths, dtype=torch.int32),
        decode_max_len=max(lengths),
    )
    ids = torch.tensor([1000 + 7 * i for i, _ in requests])
    with torch.inference_mode():
        return model(ids, torch.tensor([n - 1 for n in lengths]), kv_caches, meta)


@pytest.mark.parametrize(
    "isa", [i for i in cpu_kernels.available_isas() if linear_method.GGUF_MAX_ROWS[i] > 0]
)
def test_each_row_of_a_fused_step_is_its_own_step(
    default_model_path: str, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TREADLE_CPU_ISA", isa)
    monkeypatch.setattr(cpu_kernels, "_selected", [])
    source = resolve_model(default_model_path)
    model = load_model(source, read_arch(source), torch.float32, torch.device("cpu"), 512)
    assert model.fused is not None and model.fused.kernels.isa == isa
    torch.manual_seed(0)
    shape = (model.num_kv_heads, 10 * BLOCKS_EACH, BLOCK_SIZE, model.head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(model.num_layers)]
    lengths = [3, 17, 40, 41, 42, 100, 7, 63, 250]  # 9 rows: past the register path's 8
    requests = list(enumerate(lengths))
    for rows in (3, 5, len(lengths)):
        together = decode_step(model, requests[:rows], [(k.clone(), v.clone()) for k, v in caches])
        with torch.inference_mode():
            logits = model.compute_logits(together)
        for r in range(rows):
            # (At avx2 a 1- or 2-row step takes the sum way: other bits. There "alone" is
            # the row beside two others, past it.)
            mates = [requests[r]]
            if isa in SUM_WAY_ISAS:
                mates += [requests[(r + 1) % len(requests)], requests[(r + 2) % len(requests)]]
            with_mates = decode_step(model, mates, [(k.clone(), v.clone()) for k, v in caches])
            alone = with_mates[:1]
            assert torch.equal(together[r : r + 1], alone), (rows, r)
            with torch.inference_mode():
                assert torch.equal(logits[r : r + 1], model.compute_logits(with_mates)[:1]), (
                    rows,
                    r,
                )
