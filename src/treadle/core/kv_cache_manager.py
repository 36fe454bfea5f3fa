"""KV-cache blocks: allocation per request, automatic prefix caching, LRU reuse.

Invariants:
- A block is either in use (ref_count > 0, owned by one or more requests) or free (ref_count
  0, in `free` in LRU order: least recently freed first).
- A block whose hash is set holds exactly the tokens of that hash; it stays findable in
  `cached` while free, until it is taken for new tokens (then its hash is dropped).
- Block keys are chained: sha256(parent key + this block's token ids as int64), starting from
  a random root per manager, so equal keys mean equal whole prefixes short of a sha256
  collision (vLLM's default since GHSA-rm76-4mrf-v9r8; Python's `hash()` of small ints
  collides at will). A cached block also keeps its parent key and its tokens, and a hit is
  used only if both match the request's: a collision can cost a hit, never share KV. Only full
  blocks are hashed.
- A block of a prompt given as embeddings (`prompt_embeds`) holds placeholder token ids; its
  key also takes the sha256 of those positions' embedding bytes (`Request.embeds_bytes`), so
  two prompts whose embeddings differ anywhere in a block (and in every block after it) share
  none of them, and never share one with a prompt of token ids. Likewise a block that an
  image's placeholder tokens reach into takes that image's pixel hash: two prompts with
  different images share no block from the first image on.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from treadle.core.request import Request


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    # Set with `hash`: what it was computed from, checked on every hit.
    parent: bytes | None = None
    tokens: tuple[int, ...] | None = None


@dataclass(slots=True, eq=False)
class RestoreSlot:
    """A block held for one whole block of a prompt being restored from disk."""

    block: Block
    new: bool
    """It is to be filled from the file (else it already held these tokens)."""
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]


def block_key(parent: bytes, token_ids: list[int], embeds: bytes = b"") -> bytes:
    """The key of a full block: sha256 of the parent's key, the block's token ids and, for
    positions of a prompt given as embeddings, the sha256 of their `embeds` bytes."""
    extra = hashlib.sha256(embeds).digest() if embeds else b""
    return hashlib.sha256(parent + array("q", token_ids).tobytes() + extra).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.root = os.urandom(32)  # the parent key of every first block
        self.req_blocks: dict[str, list[Block]] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """The longest cached prefix of a new request, as blocks and tokens. At least one
        token is always left to compute, so the step has logits to sample from."""
        if not self.enable_prefix_caching:
            return [], 0
        self._hash_full_blocks(req)
        hits: list[Block] = []
        max_blocks = (req.num_tokens - 1) // self.block_size
        size, tokens, parent = self.block_size, req.all_token_ids, self.root
        for i, block_hash in enumerate(req.block_hashes[:max_blocks]):
            block = self.cached.get(block_hash)
            if (
                block is None
                or block.parent != parent
                or block.tokens != tuple(tokens[i * size : (i + 1) * size])
            ):
                break
            hits.append(block)
            parent = block_hash
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one admitted request's lookup (not the retries of one that had to wait)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: list[Block] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `req` (after its computed ones, and
        after the `computed` prefix hits of a new request). Returns the new block ids, or None
        (and changes nothing) when there are not enough free blocks."""
        computed = computed or []
        owned = self.req_blocks.get(req.request_id, [])
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(owned) - len(computed)
        reusable_free = sum(1 for b in computed if b.ref_count == 0)
        if needed > len(self.free) - reusable_free:
            return None
        for block in computed:
            if block.ref_count == 0:
                del self.free[block.block_id]
            block.ref_count += 1
        new_blocks = [self._take_free_block() for _ in range(max(0, needed))]
        self.req_blocks[req.request_id] = owned + computed + new_blocks
        return [b.block_id for b in computed + new_blocks]

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks that `req` has filled with computed tokens, for later reuse."""
        if not self.enable_prefix_caching:
            return
        self._hash_full_blocks(req)
        blocks = self.req_blocks.get(req.request_id, [])
        num_full = min(req.num_computed_tokens // self.block_size, len(blocks))
        size, tokens = self.block_size, req.all_token_ids
        for i, (block, block_hash) in enumerate(
            zip(blocks[:num_full], req.block_hashes[:num_full], strict=True)
        ):
            if block.hash is None and block_hash not in self.cached:
                block.hash = block_hash
                block.parent = req.block_hashes[i - 1] if i else self.root
                block.tokens = tuple(tokens[i * size : (i + 1) * size])
                self.cached[block_hash] = block

    def free_request(self, req: Request) -> None:
        """Give back the blocks of a finished or preempted request (tail first, so that the
        tail is evicted before the shared prefix)."""
        for block in reversed(self.req_blocks.pop(req.request_id, [])):
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block.block_id] = block

    # -- prompt caches on disk (`worker/kv_file.py`) -----------------------------------------

    def cached_prefix(self, token_ids: list[int]) -> list[Block]:
        """The cached blocks of the longest whole-block prefix of `token_ids` (what saving a
        prompt can write)."""
        found: list[Block] = []
        for key, parent, tokens in self._chain(token_ids):
            block = self._cached(key, parent, tokens)
            if block is None:
                break
            found.append(block)
        return found

    def claim_for_restore(self, token_ids: list[int]) -> list[RestoreSlot]:
        """Hold a block for each whole block of `token_ids`, in order: one already cached for
        it, else a free one to fill (the restore stops where no block is free). Each is held
        (ref_count) until `finish_restore`."""
        slots: list[RestoreSlot] = []
        for key, parent, tokens in self._chain(token_ids):
            block = self._cached(key, parent, tokens)
            new = block is None
            if block is None:
                if not self.free or key in self.cached:  # (a collision: stop here)
                    break
                block = self._take_free_block()
            else:
                if block.ref_count == 0:
                    del self.free[block.block_id]
                block.ref_count += 1
            slots.append(RestoreSlot(block, new, key, parent, tokens))
        return slots

    def finish_restore(self, slots: list[RestoreSlot], filled: bool) -> None:
        """Register the filled blocks in the prefix cache (when `filled`) and let go of them
        all, tail first (as a finished request's): they stay cached until their space is
        needed."""
        if filled:
            for slot in slots:
                if slot.new:
                    block = slot.block
                    block.hash, block.parent, block.tokens = slot.key, slot.parent, slot.tokens
                    self.cached[slot.key] = block
        for slot in reversed(slots):
            slot.block.ref_count -= 1
            if slot.block.ref_count == 0:
                self.free[slot.block.block_id] = slot.block

    def _chain(self, token_ids: list[int]) -> list[tuple[bytes, bytes, tuple[int, ...]]]:
        """(key, parent key, tokens) of each whole block of `token_ids`."""
        out, parent, size = [], self.root, self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            tokens = tuple(token_ids[start : start + size])
            key = block_key(parent, list(tokens))
            out.append((key, parent, tokens))
            parent = key
        return out

    def _cached(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> Block | None:
        block = self.cached.get(key)
        if block is None or block.parent != parent or block.tokens != tokens:
            return None
        return block

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.hash = block.parent = block.tokens = None
        self.cached.clear()

    def _take_free_block(self) -> Block:
        _, block = self.free.popitem(last=False)
        if block.hash is not None:
            del self.cached[block.hash]
            block.hash = block.parent = block.tokens = None
        block.ref_count = 1
        return block

    def _hash_full_blocks(self, req: Request) -> None:
        hashes, size = req.block_hashes, self.block_size
        parent = hashes[-1] if hashes else self.root
        for start in range(len(hashes) * size, req.num_tokens - size + 1, size):
            tokens = req.all_token_ids[start : start + size]
            parent = block_key(parent, tokens, req.embeds_bytes(start, start + size))
            hashes.append(parent)
