"""The request's view of the KV cache: prefix hits, allocate_slots, free (no torch)."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from dataclasses import dataclass

from engine.core.block_hashing import make_block_hasher
from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.kv_cache_groups import KVCacheSpec, KVGroup, make_groups
from engine.core.kv_cache_groups import cdiv as cdiv  # callers import it from here
from engine.core.kv_event_log import describe_stored, split_key, stored_info
from engine.core.kv_marks import new_log
from engine.core.request import Request

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


class KVCacheManager:
    """Every KV cache group's block tables over one shared block pool.

    group_windows: one entry per group, 0 for full attention, W for a sliding window of W
    tokens (engine/core/kv_cache_groups.py); the default is one full-attention group. Each request
    has one block table per group; allocation, prefix hits and free are one operation across
    groups, so a request holds blocks in every group or in none.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        group_windows: tuple[int, ...] = (0,),
        max_num_batched_tokens: int | None = None,
        block_hash_algo: str = "builtin",
    ) -> None:
        self.block_size = block_size
        # None: hash_block_tokens; else vLLM's hash (--prefix-caching-hash-algo)
        self.block_hasher = make_block_hasher(block_hash_algo)
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        spec = KVCacheSpec(tuple(group_windows), tuple(() for _ in group_windows))
        self.groups = make_groups(spec, block_size, self.block_pool)
        self.is_hybrid = spec.is_hybrid  # sliding blocks to return, several tables
        self.max_num_batched_tokens = max_num_batched_tokens
        first = self.groups[0]  # group 0's tables keep their old names for single-group callers
        self.req_to_blocks = first.req_to_blocks
        self.req_to_block_ids = first.req_to_block_ids  # grows with req_to_blocks, never rebuilt
        self.num_cached_blocks = first.num_cached_blocks
        self.req_to_block_hashes: dict[str, list[bytes]] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Lookups (tokens, hit tokens) counted in the stats only once the request is admitted,
        # so a waiting head that is looked up every step while the pool is short counts once.
        self._pending_queries: dict[str, tuple[int, int]] = {}
        # Copy-on-write (forks): requests whose next write may land in a block another request
        # also holds (set by fork, cleared by their next allocate_slots, which copies such
        # blocks first); the (src, dst) block copies owed before the step's forward pass (the
        # runner runs them, read before write); requests whose table entries were replaced.
        self.cow_requests: set[str] = set()
        self.fork_members: set[str] = set()  # forked (parent or child) and not freed since
        self.pending_copies: list[tuple[int, int]] = []
        self.replaced_tables: set[str] = set()
        self.num_cow_copies_total = 0
        self.cow_log = new_log()  # recent copies, for the KV map (engine/core/kv_marks.py)
        self.tier = None  # the second KV tier (engine/core/kv_tier.py) holds blocks while loading

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def max_blocks_per_request(self, num_tokens: int) -> int:
        """Most blocks one request with num_tokens KV tokens holds at once, over all groups: a
        sliding group's need stops growing at its window plus one step's chunk."""
        chunk = self.max_num_batched_tokens or num_tokens
        return sum(g.max_blocks_per_request(num_tokens, chunk) for g in self.groups)

    def _block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of every full block of the request's known tokens, extended incrementally."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else None
            if self.block_hasher is not None:
                hashes.append(self.block_hasher(parent, tokens[start : start + bs], request, start))
                continue
            extra = request.block_extra_keys(start, start + bs)
            hashes.append(hash_block_tokens(parent, tokens[start : start + bs], extra))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        """Longest cached prefix, capped so the last token is always recomputed for logits.

        Returns (hit blocks, hit tokens): with one group a list of blocks, with several one list
        per group, where a sliding group has None for the blocks before its window (only the
        last window must be cached). The blocks are not yet held: pass them to allocate_slots,
        which touches them.
        """
        # A hit skips prompt rows, and prompt logprobs need every prompt position computed.
        # Mean/CLS pooling needs every prompt position's hidden state too (engine/core/pooling.py).
        if (
            not self.enable_caching
            or request.sampling_params.prompt_logprobs is not None
            or request.skip_reading_prefix_cache
        ):
            return ([[] for _ in self.groups] if self.num_groups > 1 else []), 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        num_hit, agreed = max_blocks, False
        while not agreed:  # each group may shorten the hit; stop when all agree on one length
            before = num_hit
            for group in self.groups:
                num_hit = group.find_hit(hashes, num_hit)
            agreed = num_hit == before or self.num_groups == 1
        hits = [g.hit_blocks(hashes, num_hit) for g in self.groups]
        num_hit_tokens = num_hit * self.block_size
        self._pending_queries[request.request_id] = (request.num_tokens, num_hit_tokens)
        return (hits if self.num_groups > 1 else hits[0]), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Blocks for num_new_tokens more tokens (every group's, in group order), or None if the
        pool is short, with no change but the return of blocks that slid out of a window.

        | skipped (sliding groups) | computed | new_computed (prefix hit) | new (this step) |
        """
        rid = request.request_id
        groups = self.groups
        hits_per_group = self._hits_per_group(new_computed_blocks)
        if self.is_hybrid:  # dead blocks first: they may be what this allocation needs
            for group in groups:
                group.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens
        num_new = [
            g.num_new_blocks(rid, num_tokens, len(h)) for g, h in zip(groups, hits_per_group)
        ]
        # Hit blocks that sit in the free queue stop being free once touched.
        num_evictable_hits = sum(
            1 for hits in hits_per_group for b in hits if b is not None and b.ref_cnt == 0
        )
        pool = self.block_pool
        cow = self._shared_in_write_range(rid, num_computed, num_tokens) if (
            self.cow_requests and rid in self.cow_requests
        ) else ()
        if sum(num_new) + len(cow) > pool.get_num_free_blocks() - num_evictable_hits:
            return None
        if cow:
            self._copy_on_write(rid, cow)
        self.cow_requests.discard(rid)
        self._commit_query(rid)
        # Every group's hits leave the free queue before any new block is taken from it: a new
        # block for one group must never be another group's hit, evicted.
        for hits in hits_per_group:
            pool.touch(b for b in hits if b is not None)
        new_blocks: list[KVCacheBlock] = []
        for group, hits, n in zip(groups, hits_per_group, num_new):
            blocks = pool.get_new_blocks(n) if n else []
            group.append(rid, hits, blocks)
            new_blocks += blocks
        if self.enable_caching:
            num_full = min(num_tokens, request.num_tokens) // self.block_size
            hashes = self._block_hashes(request)
            events = pool.kv_events
            mark = len(events) if events is not None else 0
            for group in groups:
                group.cache_blocks(rid, hashes, num_full)
            if events is not None and len(events) > mark:
                describe_stored(events, mark, hashes, request.all_token_ids, self.block_size,
                                stored_info(request, self.block_hasher, self.block_size))
        return new_blocks

    # ---- forks and copy-on-write ---------------------------------------------------------------
    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """child (holding nothing) shares every block of parent covering tokens [0, num_tokens),
        in every group, a partly filled last block included (ref counts up; nothing copied).

        The first write of either into a block the other still holds copies it first
        (allocate_slots). child's tokens must equal parent's up to num_tokens.
        """
        pid, cid = parent.request_id, child.request_id
        assert cid not in self.req_to_blocks, f"{cid} already holds blocks"
        num_blocks = cdiv(num_tokens, self.block_size)
        for group in self.groups:
            blocks = group.req_to_blocks.get(pid, [])[:num_blocks]
            assert len(blocks) == num_blocks, f"{pid} holds no KV for {num_tokens} tokens"
            self.block_pool.touch(b for b in blocks if b is not None)
            group.req_to_blocks[cid] = list(blocks)
            group.req_to_block_ids[cid] = list(group.req_to_block_ids[pid][:num_blocks])
            num_cached = min(group.num_cached_blocks.get(pid, 0), num_tokens // self.block_size)
            group.num_cached_blocks[cid] = num_cached
        hashes = self.req_to_block_hashes.get(pid, [])
        self.req_to_block_hashes[cid] = hashes[: num_tokens // self.block_size]
        self.cow_requests.update((pid, cid))
        self.fork_members.update((pid, cid))

    def _shared_in_write_range(
        self, rid: str, start: int, end: int
    ) -> list[tuple[KVGroup, int]]:
        """(group, table index) of every held block another request also holds, among those
        tokens [start, end) are written into."""
        bs = self.block_size
        shared = []
        for group in self.groups:
            blocks = group.req_to_blocks.get(rid, ())
            for i in range(start // bs, min(cdiv(end, bs), len(blocks))):
                block = blocks[i]
                if block is not None and block.ref_cnt > 1:
                    shared.append((group, i))
        return shared

    def _copy_on_write(self, rid: str, cow: list[tuple[KVGroup, int]]) -> None:
        """Gives rid a fresh block for each shared one it is about to write into, and records
        the copy. A copy is unhashed: a full one's content is cached already (by its source),
        a partial one is cached by cache_blocks once it fills."""
        pool = self.block_pool
        fresh = pool.get_new_blocks(len(cow))
        for (group, i), new in zip(cow, fresh):
            old = group.req_to_blocks[rid][i]
            group.req_to_blocks[rid][i] = new
            group.req_to_block_ids[rid][i] = new.block_id
            pool.free_blocks([old])  # ref > 1: only a reference goes
            self.pending_copies.append((old.block_id, new.block_id))
            self.cow_log.append((new.block_id, rid, group.index, i))
        self.num_cow_copies_total += len(cow)
        self.replaced_tables.add(rid)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The step's (src, dst) copies, for the runner to run before its forward pass."""
        copies, self.pending_copies = self.pending_copies, []
        # A dst freed and reused as another copy's dst in the same step: the last copy wins.
        return list({dst: (src, dst) for src, dst in copies}.values())

    def take_replaced_table(self, request_id: str) -> bool:
        """Whether request_id's table had entries replaced (copied) since the last call."""
        if request_id in self.replaced_tables:
            self.replaced_tables.discard(request_id)
            return True
        return False

    def _hits_per_group(self, new_computed_blocks: list | None) -> list[list]:
        if not new_computed_blocks:
            return [[] for _ in self.groups] if self.num_groups > 1 else [[]]
        return new_computed_blocks if self.num_groups > 1 else [new_computed_blocks]

    def _commit_query(self, request_id: str) -> None:
        pending = self._pending_queries.pop(request_id, None)
        if pending is not None:
            self.prefix_cache_stats.num_queries += pending[0]
            self.prefix_cache_stats.num_hits += pending[1]

    def rollback(self, request: Request, num_computed_tokens: int) -> bool:
        """Gives back the blocks past num_computed_tokens (rejected draft tokens' slots).

        Such blocks hold only unverified tokens, so they were never hashed: they return to the
        free queue's head. Returns whether any block was freed.
        """
        keep = cdiv(num_computed_tokens, self.block_size)
        freed = False
        for group in reversed(self.groups):
            freed |= group.truncate(request.request_id, keep)
        return freed

    def free(self, request: Request) -> None:
        """Release every group's blocks, each table in reverse (a chain's tail is evicted first)."""
        rid = request.request_id
        for group in reversed(self.groups):
            group.free(rid)
        self._pending_queries.pop(rid, None)
        self.cow_requests.discard(rid)
        self.fork_members.discard(rid)
        self.replaced_tables.discard(rid)
        if request.finished:  # a preempted request keeps its hashes: its tokens do not change
            self.req_to_block_hashes.pop(rid, None)

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The live block table of a request in one group (do not mutate); empty if none."""
        return self.groups[group].req_to_block_ids.get(request_id, [])

    def get_num_held_blocks(self, request_id: str) -> int:
        """Real blocks (not placeholders) the request holds over all groups."""
        return sum(
            sum(1 for b in g.req_to_blocks.get(request_id, ()) if b is not None)
            for g in self.groups
        )

    def check_integrity(self) -> None:
        """The pool's invariants, plus: each ref count equals the number of (request, group)
        tables holding the block, no table holds a block twice, only hashed blocks are shared,
        a request holds blocks in every group or none, and the id tables mirror the blocks."""
        self.block_pool.check_integrity()
        holders: Counter[int] = Counter()
        for group in self.groups:
            holders.update(group.check_integrity())
            assert group.req_to_blocks.keys() == self.req_to_blocks.keys(), "groups disagree"
        if self.tier is not None:
            holders.update(b.block_id for b in self.tier.held_blocks())
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], f"{block} has the wrong ref count"
        # Only prefix hits (hashed blocks) and forks share blocks.
        for group in self.groups:
            for rid, blocks in group.req_to_blocks.items():
                if rid not in self.fork_members:
                    for b in blocks:
                        assert b is None or b.ref_cnt <= 1 or b.block_hash is not None, (
                            f"{b} shared unhashed outside a fork"
                        )
        assert self.cow_requests <= self.fork_members <= self.req_to_blocks.keys()

    def enable_kv_events(self) -> None:
        """Record KV-cache events from now on (engine/core/kv_event_log.py has their shape)."""
        self.block_pool.kv_events = []

    def take_kv_events(self) -> list[tuple]:
        events = self.block_pool.kv_events
        if not events:
            return []
        self.block_pool.kv_events = []
        # ("stored", group, hashes, parent, tokens, info), ("removed", group, hash), ("cleared",)
        return [("removed", *split_key(e[1])) if e[0] == "removed" else e for e in events]

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats
