"""KV cache groups: layers that attend the same way share one block table per request (no torch).

A group is full attention (window 0: every block stays) or a sliding window W (a query at
position i sees keys i - W < j <= i, so blocks wholly before the window of every future query
go back to the pool). The layout follows vLLM's hybrid allocator: every group has the same
number of layers, KV tensor slot j holds the j-th layer of every group, and one block pool
serves all groups, so a block id names the same bytes whichever group holds it.

    layers:  L0 L1 L2 L3 L4 L5   (windows 512 512 0 512 512 0)
    groups:  g0 = full [L2, L5]   g1 = 512 [L0, L1]   g2 = 512 [L3, L4]
    slots:   slot 0 = L2, L0, L3   slot 1 = L5, L1, L4
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.core.block_pool import BlockPool, KVCacheBlock

PLACEHOLDER_BLOCK_ID = 0  # table entry of a block slid out of the window: kernels never read it


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass(frozen=True)
class KVCacheSpec:
    """Group windows (0 = full attention) and the layers of each group, in slot order."""

    windows: tuple[int, ...]
    layer_groups: tuple[tuple[int, ...], ...]

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """KV tensors to allocate: one per layer position within a group."""
        return max(len(g) for g in self.layer_groups)

    @property
    def is_hybrid(self) -> bool:
        """Anything but one full-attention group (the layout every model had before groups)."""
        return self.windows != (0,)

    def group_and_slot(self) -> dict[int, tuple[int, int]]:
        """layer index -> (group, slot)."""
        return {
            layer: (g, slot)
            for g, layers in enumerate(self.layer_groups)
            for slot, layer in enumerate(layers)
        }


def plan_kv_groups(layer_windows: list[int]) -> KVCacheSpec:
    """Groups of equal size from per-layer windows (0 = full attention).

    The size leaves the fewest padded layer slots (a padded slot is KV memory no layer uses),
    then the fewest groups; full-attention groups come first, then windows in increasing order.
    """
    kinds: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1:
        window, layers = next(iter(kinds.items()))
        return KVCacheSpec((window,), (tuple(layers),))

    def cost(size: int) -> tuple[int, int]:
        groups = sum(cdiv(len(ls), size) for ls in kinds.values())
        return groups * size - len(layer_windows), groups

    size = min(range(1, min(len(ls) for ls in kinds.values()) + 1), key=cost)
    windows, layer_groups = [], []
    for window in sorted(kinds):
        layers = kinds[window]
        for start in range(0, len(layers), size):
            windows.append(window)
            layer_groups.append(tuple(layers[start : start + size]))
    return KVCacheSpec(tuple(windows), tuple(layer_groups))


def max_group_blocks(window: int, block_size: int, num_tokens: int, max_chunk: int) -> int:
    """Most blocks a request with num_tokens KV tokens holds at once in a group, computing at
    most max_chunk tokens per step."""
    if not window:
        return cdiv(num_tokens, block_size)
    # A step's queries [c, c + n) read keys from c - W + 1: a span of n + W - 1 tokens.
    span = min(max_chunk, num_tokens) + window - 1
    return min(cdiv(num_tokens, block_size), cdiv(span - 1, block_size) + 1)


def max_blocks_per_request(
    windows: tuple[int, ...], block_size: int, num_tokens: int, max_chunk: int
) -> int:
    return sum(max_group_blocks(w, block_size, num_tokens, max_chunk) for w in windows)


class KVGroup:
    """One group's block tables. Full attention: a request holds every block it wrote.

    Table entries are positions: entry b covers tokens [b * block_size, (b + 1) * block_size).
    A sliding group replaces the blocks it returned with None (and PLACEHOLDER_BLOCK_ID in the
    id table), so positions never shift.
    """

    def __init__(
        self,
        index: int,
        window: int,
        block_size: int,
        pool: BlockPool,
        hash_groups: bytearray | None = None,
    ) -> None:
        self.index, self.window, self.block_size, self.pool = index, window, block_size, pool
        # Per block: the group whose prefix-cache key it was last cached under (shared by all
        # groups of a pool; read where the pool's hash tag is set). For the KV view only.
        self.hash_groups = bytearray(pool.num_blocks) if hash_groups is None else hash_groups
        self.num_window_freed_blocks_total = 0  # blocks returned as they slid out of the window
        # Group 0 keys blocks by the bare chained hash (as before groups); others append their
        # index, so each group's copy of the same tokens is its own cache entry.
        self.key_suffix = b"" if index == 0 else b"g" + index.to_bytes(2, "little")
        self.req_to_blocks: dict[str, list[KVCacheBlock | None]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    def key(self, block_hash: bytes) -> bytes:
        return block_hash + self.key_suffix if self.key_suffix else block_hash

    # ---- prefix hits -------------------------------------------------------------------------
    def find_hit(self, hashes: list[bytes], max_blocks: int) -> int:
        """Most leading blocks (<= max_blocks) this group can serve: a prefix of cached blocks."""
        get = self.pool.get_cached_block
        n = 0
        while n < max_blocks and get(self.key(hashes[n])) is not None:
            n += 1
        return n

    def hit_blocks(self, hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock | None]:
        get = self.pool.get_cached_block
        first = self.num_skipped_blocks(num_blocks * self.block_size)
        hits: list[KVCacheBlock | None] = [None] * first
        hits.extend(get(self.key(h)) for h in hashes[first:num_blocks])
        return hits

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at or after num_computed_tokens can see: none here."""
        return 0

    # ---- allocation --------------------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Return the blocks that slid out of the window (sliding groups only)."""

    def num_new_blocks(self, request_id: str, num_tokens: int, num_hits: int) -> int:
        table = self.req_to_blocks.get(request_id)
        num_held = len(table) if table else 0
        return max(cdiv(num_tokens, self.block_size) - num_held - num_hits, 0)

    def append(
        self, request_id: str, hits: list[KVCacheBlock | None], new: list[KVCacheBlock]
    ) -> None:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        ids = self.req_to_block_ids.setdefault(request_id, [])
        if hits:
            blocks.extend(hits)
            ids.extend(PLACEHOLDER_BLOCK_ID if b is None else b.block_id for b in hits)
            if not self.num_cached_blocks.get(request_id):
                self.num_cached_blocks[request_id] = len(hits)  # hits carry their hashes
        blocks.extend(new)
        ids.extend(b.block_id for b in new)

    def cache_blocks(self, request_id: str, hashes: list[bytes], num_full: int) -> None:
        """Register this request's full blocks up to num_full under this group's keys."""
        start = self.num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        blocks = self.req_to_blocks[request_id]
        cached = self.pool.cached_block_hash_to_block
        for i in range(start, num_full):
            block = blocks[i]
            if block is None or block.block_hash is not None:
                continue  # slid out before it filled (never here), or a hit: cached already
            assert block.ref_cnt > 0, f"caching {block}, which nobody holds"
            key = self.key(hashes[i])
            if key not in cached:  # same content computed twice: keep the first copy
                self.pool.cache_block(block, key)
                self.hash_groups[block.block_id] = self.index
        self.num_cached_blocks[request_id] = num_full

    def truncate(self, request_id: str, num_blocks: int) -> bool:
        """Frees the table's entries from num_blocks on, last first; they must be unhashed."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or len(blocks) <= num_blocks:
            return False
        assert self.num_cached_blocks.get(request_id, 0) <= num_blocks, "truncating cached blocks"
        tail = blocks[num_blocks:]
        assert all(b is None or b.block_hash is None for b in tail), "a verified block is cached"
        del blocks[num_blocks:]
        del self.req_to_block_ids[request_id][num_blocks:]
        self.pool.free_blocks(b for b in reversed(tail) if b is not None)
        return True

    def free(self, request_id: str) -> None:
        """Release in reverse so a chain's tail is evicted before its head."""
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(b for b in reversed(blocks) if b is not None)
        self.req_to_block_ids.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """Most blocks one request of num_tokens KV tokens holds at once in this group."""
        return max_group_blocks(self.window, self.block_size, num_tokens, max_chunk)

    def check_integrity(self) -> list[int]:
        """Asserts the tables mirror each other; returns the block ids held (for ref counts)."""
        assert self.req_to_blocks.keys() == self.req_to_block_ids.keys()
        held: list[int] = []
        for rid, blocks in self.req_to_blocks.items():
            ids = [PLACEHOLDER_BLOCK_ID if b is None else b.block_id for b in blocks]
            assert self.req_to_block_ids[rid] == ids, f"block table of {rid} is stale"
            real = [b.block_id for b in blocks if b is not None]
            assert len(set(real)) == len(real), f"{rid} holds a block twice"
            held += real
        return held


class SlidingWindowGroup(KVGroup):
    """Keeps only the blocks a future query can see: for the next query at position p, keys
    p - W < j, so blocks ending at or before p - W + 1 go back to the pool (their hashes stay
    until evicted, as any freed block's)."""

    def find_hit(self, hashes: list[bytes], max_blocks: int) -> int:
        """Most blocks n <= max_blocks whose last window (blocks skipped(n) .. n-1) is cached.

        Scans right to left: a missing block j means no hit ends after j, so the scan resumes
        below it and looks at each block at most once.
        """
        get, key = self.pool.get_cached_block, self.key
        n = max_blocks
        while n > 0:
            first = self.num_skipped_blocks(n * self.block_size)
            j = n - 1
            while j >= first and get(key(hashes[j])) is not None:
                j -= 1
            if j < first:
                return n
            n = j
        return 0

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return max(num_computed_tokens - self.window + 1, 0) // self.block_size

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        ids = self.req_to_block_ids[request_id]
        end = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
        freed: list[KVCacheBlock] = []
        # Walk back from the window's edge to the first placeholder: everything before is gone.
        i = end - 1
        while i >= 0 and blocks[i] is not None:
            freed.append(blocks[i])
            blocks[i] = None
            ids[i] = PLACEHOLDER_BLOCK_ID
            i -= 1
        if freed:
            self.pool.free_blocks(reversed(freed))  # oldest first: evicted before newer ones
            self.num_window_freed_blocks_total += len(freed)



def make_groups(
    spec: KVCacheSpec, block_size: int, pool: BlockPool
) -> list[KVGroup]:
    make: Callable[..., KVGroup]
    groups = []
    hash_groups = bytearray(pool.num_blocks)
    for index, window in enumerate(spec.windows):
        make = SlidingWindowGroup if window else KVGroup
        groups.append(make(index, window, block_size, pool, hash_groups))
    return groups
