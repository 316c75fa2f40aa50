"""Physical KV blocks: ref counts, an LRU free queue and the prefix-cache hash map (no torch)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVCacheBlock:
    """One physical block; prev/next link it into the free queue while ref_cnt == 0."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list threaded through the blocks themselves: O(1) everywhere, no allocs.

    head sentinel <-> evicted first <-> ... <-> kept longest <-> tail sentinel
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels, never handed out
        self._tail = KVCacheBlock(-2)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not self._tail, "free queue is empty"
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The n least recently freed blocks, unlinked in one splice."""
        assert n <= self.num_free_blocks, "free queue is too short"
        blocks = []
        block = self._head.next_free
        for _ in range(n):
            blocks.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self._head.next_free, block.prev_free = block, self._head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = nxt.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def iter_reversed(self) -> Iterator[KVCacheBlock]:
        block = self._tail.prev_free
        while block is not self._head:
            yield block
            block = block.prev_free


class BlockPool:
    """All physical blocks. A free block may still hold a cached prefix until it is reused.

    Every block is either held (ref_cnt > 0, not in the free queue) or free (ref_cnt == 0, in
    the queue). A hashed block is in `cached_block_hash_to_block` whether held or free.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.num_cached_free_blocks = 0  # free blocks with a hash; read every step, so counted
        # Per block: 0 without a hash, else a tag (1..255, cycling) that changes with the hash,
        # so two copies tell a reused block from a kept one; one memcpy (engine/core/kv_view.py).
        self.hash_tags = bytearray(num_blocks)
        self._next_hash_tag = 1
        self.num_evictions_total = 0  # cached blocks reused for other content
        # KV-cache events, in order, when enabled (engine/kv_events.py publishes them):
        # ("stored", key), ("removed", key), ("cleared",). None: nothing is recorded.
        self.kv_events: list[tuple] | None = None
        # (block id, key) of every hashed block evicted, when a second KV tier keeps them
        # (engine/core/kv_tier.py). None: nothing is recorded.
        self.evicted: list[tuple[int, bytes]] | None = None

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_num_cached_free_blocks(self) -> int:
        return self.num_cached_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests; free-but-cached blocks count as free."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop from the head (least valuable first), evicting any cached hash they carried."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                del self.cached_block_hash_to_block[block.block_hash]
                if self.kv_events is not None:
                    self.kv_events.append(("removed", block.block_hash))
                if self.evicted is not None:
                    self.evicted.append((block.block_id, block.block_hash))
                block.block_hash = None
                self.hash_tags[block.block_id] = 0
                self.num_cached_free_blocks -= 1
                self.num_evictions_total += 1
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a hit: cached blocks with no holder leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; among hashed blocks the first freed is the first evicted.

        Blocks reaching ref 0 without a hash go to the head (reused first), hashed ones to the
        tail (kept longest for hits). The queue insert is inlined: this runs for every block.
        """
        queue = self.free_block_queue
        head, tail = queue._head, queue._tail
        num_freed = num_cached = 0
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            assert block.ref_cnt == 0, f"double free of {block}"
            if block.block_hash is None:
                prev = head
            else:
                prev = tail.prev_free
                num_cached += 1
            nxt = prev.next_free
            block.prev_free = prev
            block.next_free = nxt
            prev.next_free = nxt.prev_free = block
            num_freed += 1
        queue.num_free_blocks += num_freed
        self.num_cached_free_blocks += num_cached

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[bytes], start: int, end: int
    ) -> None:
        """Register blocks[start:end] (full, KV written this step or earlier) under their hashes."""
        if not self.enable_caching:
            return
        cached = self.cached_block_hash_to_block
        for i in range(start, end):
            block = blocks[i]
            assert block.ref_cnt > 0, f"caching {block}, which nobody holds"
            if block.block_hash is not None:
                continue  # a prefix hit: already cached
            block_hash = block_hashes[i]
            if block_hash in cached:
                continue  # same content computed twice; keep the first copy as the cached one
            self.cache_block(block, block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register one held, full, unhashed block under a hash no other block has."""
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        self.hash_tags[block.block_id] = self._next_hash_tag
        self._next_hash_tag = self._next_hash_tag % 255 + 1
        if self.kv_events is not None:
            self.kv_events.append(("stored", block_hash))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no request holds a block."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.num_cached_free_blocks = 0
        self.hash_tags[:] = bytes(self.num_blocks)
        if self.kv_events is not None:
            self.kv_events.append(("cleared",))
        return True

    def check_integrity(self) -> None:
        """free (ref 0, in queue) + held (ref > 0) == total; queue, hash map and counters agree."""
        queue = self.free_block_queue
        free = list(queue)
        assert list(reversed(free)) == list(queue.iter_reversed()), "free queue links broken"
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == queue.num_free_blocks, "free queue count is off"
        held = 0
        for block in self.blocks:
            in_queue = block.block_id in free_ids
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            assert (block.ref_cnt == 0) == in_queue, f"{block} ref/queue mismatch"
            if not in_queue:
                assert block.prev_free is None and block.next_free is None, f"{block} dangles"
                held += 1
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block
            assert bool(self.hash_tags[block.block_id]) == (block.block_hash is not None)
        assert held + len(free) == self.num_blocks
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash and self.blocks[block.block_id] is block
        num_cached_free = sum(1 for b in free if b.block_hash is not None)
        assert num_cached_free == self.num_cached_free_blocks, "cached-free counter is off"
