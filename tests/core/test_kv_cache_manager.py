"""KVCacheManager: block allocation, chained prefix hashes, LRU reuse of freed cached blocks."""

import itertools

import pytest
import torch

from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.request import Request
from treadle.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_request(tokens: list[int]) -> Request:
    return Request(f"r{next(_ids)}", list(tokens), SamplingParams(), None, 0.0)


def admit(kv: KVCacheManager, req: Request) -> list[int]:
    """What the scheduler does for a new request: look up the prefix, allocate, compute all."""
    computed, num_hit = kv.get_computed_blocks(req)
    block_ids = kv.allocate_slots(req, req.num_tokens - num_hit, computed)
    assert block_ids is not None
    kv.record_prefix_lookup(req.num_tokens, num_hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return block_ids


def check_invariants(kv: KVCacheManager) -> None:
    owners: dict[int, int] = {}
    for blocks in kv.req_blocks.values():
        for b in blocks:
            owners[b.block_id] = owners.get(b.block_id, 0) + 1
    for b in kv.blocks:
        assert b.ref_count == owners.get(b.block_id, 0)
        assert (b.ref_count == 0) == (b.block_id in kv.free)
        if b.hash is not None:
            assert kv.cached[b.hash] is b
    assert all(block.hash == h for h, block in kv.cached.items())


def test_allocate_rounds_up_to_blocks_and_grows():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    req = make_request(range(5))
    assert kv.allocate_slots(req, 5) == [0, 1]
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 3) == []  # 8 tokens still fit in 2 blocks
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1) == [2]
    assert kv.block_ids(req.request_id) == [0, 1, 2]
    assert kv.usage == pytest.approx(3 / 8)
    check_invariants(kv)


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(3, BS, enable_prefix_caching=False)
    a, b = make_request(range(8)), make_request(range(8))
    assert kv.allocate_slots(a, 8) == [0, 1]
    assert kv.allocate_slots(b, 8) is None
    assert kv.block_ids(b.request_id) == [] and len(kv.free) == 1
    check_invariants(kv)


def test_free_request_returns_all_blocks():
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)
    req = make_request(range(10))
    kv.allocate_slots(req, 10)
    kv.free_request(req)
    assert kv.usage == 0.0 and kv.block_ids(req.request_id) == []
    kv.free_request(req)  # twice is harmless
    check_invariants(kv)


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make_request(range(10))
    admit(kv, a)
    b = make_request([*range(8), 99, 98, 97])
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [c.block_id for c in computed] == kv.block_ids(a.request_id)[:2]
    new_ids = kv.allocate_slots(b, b.num_tokens - num_hit, computed)
    assert new_ids is not None and new_ids[:2] == kv.block_ids(a.request_id)[:2]
    assert [blk.ref_count for blk in computed] == [2, 2]
    check_invariants(kv)


@pytest.mark.parametrize("length", [4, 8, 9, 12])
def test_hit_is_a_block_multiple_and_never_the_whole_prompt(length):
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    admit(kv, make_request(range(12)))
    _, num_hit = kv.get_computed_blocks(make_request(range(length)))
    assert num_hit % BS == 0 and num_hit <= length - 1
    assert num_hit == (length - 1) // BS * BS


def test_hashes_are_chained_over_the_whole_prefix():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    admit(kv, make_request([1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # Same second block, different first block: no hit at all.
    _, num_hit = kv.get_computed_blocks(make_request([9, 2, 3, 4, 5, 6, 7, 8, 0]))
    assert num_hit == 0
    _, num_hit = kv.get_computed_blocks(make_request([1, 2, 3, 4, 9, 6, 7, 8, 0]))
    assert num_hit == 4


def test_only_computed_full_blocks_are_cached():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    req = make_request(range(10))
    kv.allocate_slots(req, 6)
    req.num_computed_tokens = 6  # a first prefill chunk
    kv.cache_full_blocks(req)
    assert len(kv.cached) == 1
    _, num_hit = kv.get_computed_blocks(make_request(range(10)))
    assert num_hit == 4


def test_freed_cached_blocks_are_reused_by_a_later_request():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make_request(range(9))
    a_ids = admit(kv, a)
    kv.free_request(a)
    b = make_request(range(9))
    assert admit(kv, b)[:2] == a_ids[:2]
    assert kv.prefix_hits == 8 and kv.prefix_queries == 18
    check_invariants(kv)


def test_lru_evicts_tail_blocks_before_shared_prefix():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = make_request(range(13))  # 3 full blocks + 1 token
    a_ids = admit(kv, a)
    kv.free_request(a)
    # Needs 2 new blocks: the partial last block, then the deepest cached block are taken.
    other = make_request([50 + i for i in range(5)])
    assert kv.get_computed_blocks(other)[1] == 0
    assert kv.allocate_slots(other, 5) == [a_ids[3], a_ids[2]]
    assert len(kv.cached) == 2
    _, num_hit = kv.get_computed_blocks(make_request(range(13)))
    assert num_hit == 8
    check_invariants(kv)


def test_hit_on_free_cached_blocks_counts_them_as_taken():
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    a = make_request(range(9))
    admit(kv, a)
    kv.free_request(a)
    b = make_request([*range(8), 7, 7, 7, 7, 7])  # hits 2 free blocks, needs 3 more tokens
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, 9, computed) is None  # 2 hit + 3 new > 3 blocks
    assert all(blk.ref_count == 0 for blk in computed) and len(kv.free) == 3
    assert kv.allocate_slots(b, 4, computed) is not None  # 2 hit + 1 new
    assert kv.usage == 1.0
    check_invariants(kv)


def test_identical_concurrent_prompts_do_not_double_register():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a, b = make_request(range(8)), make_request(range(8))
    for req in (a, b):  # both admitted before either is cached
        assert kv.allocate_slots(req, 8) is not None
    for req in (a, b):
        req.num_computed_tokens = 8
        kv.cache_full_blocks(req)
    assert len(kv.cached) == 2
    assert [kv.cached[h].block_id for h in a.block_hashes] == kv.block_ids(a.request_id)
    check_invariants(kv)


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    admit(kv, make_request(range(9)))
    assert kv.get_computed_blocks(make_request(range(9))) == ([], 0)
    assert kv.cached == {}


def test_reset_prefix_cache_forgets_hashes():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make_request(range(9))
    admit(kv, a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request(range(9)))[1] == 0
    assert all(b.hash is None for b in kv.blocks)
    check_invariants(kv)


def test_block_keys_are_sha256_of_the_parent_key_and_the_tokens():
    import hashlib
    from array import array

    from treadle.core.kv_cache_manager import block_key

    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    req = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, req)
    first = hashlib.sha256(kv.root + array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert req.block_hashes == [first, block_key(first, [5, 6, 7, 8])]
    # The root is random per manager: another engine's keys are not predictable from here.
    assert KVCacheManager(16, BS, enable_prefix_caching=True).root != kv.root


def test_a_key_collision_never_shares_kv(monkeypatch: pytest.MonkeyPatch):
    """With a hash that collides for everything (as Python's hash() can be made to), a hit
    is still used only when the cached block holds the same tokens after the same parent."""
    import treadle.core.kv_cache_manager as kvm

    monkeypatch.setattr(kvm, "block_key", lambda parent, tokens, embeds=b"": b"collides")
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    admit(kv, make_request([1, 2, 3, 4, 5, 6, 7, 8, 0]))
    assert len(kv.cached) == 1  # every full block has the same key: only the first is cached
    # Another first block under the same key: not shared.
    _, num_hit = kv.get_computed_blocks(make_request([9, 9, 9, 9, 5, 6, 7, 8, 0]))
    assert num_hit == 0
    # Same first block: shared; the second block's key finds the first block, whose parent
    # and tokens differ: not shared.
    _, num_hit = kv.get_computed_blocks(make_request([1, 2, 3, 4, 1, 2, 3, 4, 0]))
    assert num_hit == 4
    check_invariants(kv)


def embeds_request(embeds: torch.Tensor, outputs: tuple[int, ...] = ()) -> Request:
    from treadle.prompt_embeds import placeholder_ids

    req = Request(
        f"r{next(_ids)}",
        placeholder_ids(embeds.shape[0]),
        SamplingParams(),
        None,
        0.0,
        prompt_embeds=embeds,
    )
    req.all_token_ids.extend(outputs)
    return req


def test_prompt_embeds_that_differ_in_one_element_share_no_block():
    """Blocks of an embeddings prompt are keyed by their rows' bytes (issue 23): the same
    embeddings share, one element changed shares from no block on, and placeholder ids never
    meet a prompt of token ids."""
    embeds = torch.randn(9, 8)
    kv = KVCacheManager(32, BS, enable_prefix_caching=True)
    admit(kv, embeds_request(embeds))
    assert len(kv.cached) == 2
    same = embeds_request(embeds.clone())
    assert kv.get_computed_blocks(same)[1] == 8
    for row in (0, 5):
        other = embeds.clone()
        other[row, 3] += 1e-3
        _, num_hit = kv.get_computed_blocks(embeds_request(other))
        assert num_hit == (0 if row == 0 else 4)  # the blocks before the change only
    assert kv.get_computed_blocks(make_request([0] * 9))[1] == 0  # the placeholders' own ids
    assert kv.get_computed_blocks(embeds_request(embeds.half()))[1] == 0  # same values, dtype
    # A block of embeddings and outputs is keyed by both; one of outputs alone by its ids.
    req = embeds_request(embeds[:2], outputs=(5, 6, 7, 8, 9, 10))
    admit(kv, req)
    first = embeds_request(embeds[:2].clone(), outputs=(5, 6, 7, 8, 9))
    assert kv.get_computed_blocks(first)[1] == 4
    changed = embeds[:2].clone()
    changed[1, 0] = 7.0
    assert kv.get_computed_blocks(embeds_request(changed, outputs=(5, 6, 7, 8, 9)))[1] == 0
    check_invariants(kv)
