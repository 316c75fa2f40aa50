"""The request's view of the KV cache: prefix hits, allocate_slots, free (no torch)."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from dataclasses import dataclass

from engine.block_pool import BlockPool, KVCacheBlock
from engine.request import Request

_ROOT_HASH = b"pagedserve-root"


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: list[int], extra_keys: bytes = b""
) -> bytes:
    """Chained, collision-resistant block hash: sha256(parent, tokens, extra keys)."""
    h = hashlib.sha256(parent_hash or _ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_keys)
    return h.digest()


@dataclass
class PrefixCacheStats:
    """Counted in tokens, reset by whoever reads them once per step."""

    num_queries: int = 0
    num_hits: int = 0


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}  # grows with req_to_blocks, never rebuilt
        self.req_to_block_hashes: dict[str, list[bytes]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Lookups (tokens, hit tokens) counted in the stats only once the request is admitted,
        # so a waiting head that is looked up every step while the pool is short counts once.
        self._pending_queries: dict[str, tuple[int, int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def _block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of every full block of the request's known tokens, extended incrementally."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[start : start + bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix, capped so the last token is always recomputed for logits.

        The blocks are not yet held: pass them to allocate_slots, which touches them.
        """
        # A hit skips prompt rows, and prompt logprobs need every prompt position computed.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        get_cached_block = self.block_pool.get_cached_block
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self._pending_queries[request.request_id] = (request.num_tokens, num_hit_tokens)
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Blocks for num_new_tokens more tokens, or None (and no change at all) if short.

        | computed | new_computed (prefix hit) | new (this step) |
        """
        new_computed_blocks = new_computed_blocks or []
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        num_held = len(req_blocks) if req_blocks else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(num_required - num_held - len(new_computed_blocks), 0)
        # Hit blocks that sit in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
            self.req_to_block_ids[rid] = []
        self._commit_query(rid)
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        block_ids = self.req_to_block_ids[rid]
        for added in (new_computed_blocks, new_blocks):
            req_blocks.extend(added)
            block_ids.extend(b.block_id for b in added)
        if self.enable_caching:
            self._cache_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _commit_query(self, request_id: str) -> None:
        pending = self._pending_queries.pop(request_id, None)
        if pending is not None:
            self.prefix_cache_stats.num_queries += pending[0]
            self.prefix_cache_stats.num_hits += pending[1]

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_tokens, request.num_tokens) // self.block_size
        if end > start:
            hashes = self._block_hashes(request)
            self.block_pool.cache_full_blocks(self.req_to_blocks[rid], hashes, start, end)
            self.num_cached_blocks[rid] = end

    def free(self, request: Request) -> None:
        """Release in reverse so a chain's tail is evicted before its head."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self._forget(request.request_id)
        if request.finished:  # a preempted request keeps its hashes: its tokens do not change
            self.req_to_block_hashes.pop(request.request_id, None)

    def _forget(self, request_id: str) -> None:
        self._pending_queries.pop(request_id, None)
        self.req_to_blocks.pop(request_id, None)
        self.req_to_block_ids.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The live block table of a request (do not mutate); empty if it holds none."""
        return self.req_to_block_ids.get(request_id, [])

    def check_integrity(self) -> None:
        """The pool's invariants, plus: each ref count equals the number of requests holding the
        block, no request holds a block twice, only hashed blocks are shared, and the block id
        tables mirror the block lists."""
        self.block_pool.check_integrity()
        holders: Counter[int] = Counter()
        assert self.req_to_blocks.keys() == self.req_to_block_ids.keys()
        for rid, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            assert self.req_to_block_ids[rid] == ids, f"block table of {rid} is stale"
            assert len(set(ids)) == len(ids), f"{rid} holds a block twice"
            holders.update(ids)
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], f"{block} has the wrong ref count"
            assert block.ref_cnt <= 1 or block.block_hash is not None, f"{block} shared unhashed"

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats
