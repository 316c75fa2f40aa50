"""BlockPool and its free queue: ref counts, LRU order, hash map, integrity."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def test_free_queue_starts_in_block_order_and_removes_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    q.appendleft(blocks[2])
    q.append(blocks[0])
    assert [b.block_id for b in q] == [2, 1, 3, 4, 0]


def test_allocate_and_free_restore_every_block():
    pool = BlockPool(8)
    got = pool.get_new_blocks(5)
    assert [b.ref_cnt for b in got] == [1] * 5 and pool.get_num_free_blocks() == 3
    pool.check_integrity()
    pool.free_blocks(reversed(got))
    assert pool.get_num_free_blocks() == 8 and pool.get_usage() == 0.0
    pool.check_integrity()


def test_unhashed_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h-a"], 0, 1)
    pool.free_blocks([a, b])  # a (hashed) goes to the tail, b (unhashed) to the head
    order = [blk.block_id for blk in pool.free_block_queue]
    assert order[0] == b.block_id and order[-1] == a.block_id
    assert pool.get_cached_block(b"h-a") is a


def test_reusing_a_cached_block_evicts_its_hash():
    pool = BlockPool(1)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"h"], 0, 1)
    pool.free_blocks([a])
    assert pool.get_cached_block(b"h") is a
    (again,) = pool.get_new_blocks(1)
    assert again is a and a.block_hash is None and pool.get_cached_block(b"h") is None
    pool.check_integrity()


def test_touch_takes_a_cached_free_block_out_of_the_queue():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"h"], 0, 1)
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 3
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.check_integrity()


def test_popleft_n_splices_the_head_and_leaves_the_rest_linked():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.popleft_n(0) == [] and q.num_free_blocks == 6
    got = q.popleft_n(4)
    assert [b.block_id for b in got] == [0, 1, 2, 3] and q.num_free_blocks == 2
    assert all(b.prev_free is None and b.next_free is None for b in got)
    assert [b.block_id for b in q] == [4, 5] and [b.block_id for b in q.iter_reversed()] == [5, 4]
    assert [b.block_id for b in q.popleft_n(2)] == [4, 5] and list(q) == []
    q.append(blocks[3])
    assert [b.block_id for b in q] == [3]


def test_eviction_is_lru_among_cached_blocks():
    pool = BlockPool(6)
    first, second = pool.get_new_blocks(3), pool.get_new_blocks(3)
    pool.cache_full_blocks(first, [b"a0", b"a1", b"a2"], 0, 3)
    pool.cache_full_blocks(second, [b"b0", b"b1", b"b2"], 0, 3)
    pool.free_blocks(second)  # freed earlier: least recently used
    pool.free_blocks(first)
    assert pool.get_num_cached_free_blocks() == 6
    evicted = pool.get_new_blocks(3)
    assert evicted == second
    assert all(pool.get_cached_block(h) is None for h in (b"b0", b"b1", b"b2"))
    assert [pool.get_cached_block(h) for h in (b"a0", b"a1", b"a2")] == first
    assert pool.get_num_cached_free_blocks() == 3
    pool.check_integrity()


def test_a_hit_refreshes_recency():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"x", b"y", b"z"], 0, 3)
    pool.free_blocks(blocks)  # queue: x y z
    x = pool.get_cached_block(b"x")
    pool.touch([x])
    pool.free_blocks([x])  # x is the most recently used now: queue y z x
    assert [b.block_hash for b in pool.free_block_queue] == [b"y", b"z", b"x"]
    assert pool.get_new_blocks(1)[0].block_id == blocks[1].block_id
    pool.check_integrity()


def test_caching_a_duplicate_keeps_the_first_copy():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"same"], 0, 1)
    pool.cache_full_blocks([b], [b"same"], 0, 1)
    assert pool.get_cached_block(b"same") is a and b.block_hash is None
    pool.free_blocks([b, a])
    assert [blk.block_id for blk in pool.free_block_queue] == [b.block_id, a.block_id]
    pool.check_integrity()


def test_double_free_and_caching_a_free_block_are_caught():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([a])
    pool = BlockPool(2)
    with pytest.raises(AssertionError, match="nobody holds"):
        pool.cache_full_blocks(pool.blocks, [b"h0", b"h1"], 0, 1)


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"h"], 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    assert pool.get_num_cached_free_blocks() == 1
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h") is None and pool.get_num_cached_free_blocks() == 0
    pool.check_integrity()


def test_check_integrity_catches_corruption():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    a.ref_cnt = 0  # held by nobody yet missing from the free queue: a leak
    with pytest.raises(AssertionError, match="ref/queue"):
        pool.check_integrity()
    pool = BlockPool(3)
    pool.num_cached_free_blocks = 1
    with pytest.raises(AssertionError, match="counter"):
        pool.check_integrity()


# ---- property-based: random allocate / cache / hit / free against a reference model --------
NUM_BLOCKS = 8


class BlockPoolMachine(RuleBasedStateMachine):
    """Holders are lists of blocks; the model free list is the expected LRU order, head first."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.model_free = list(range(NUM_BLOCKS))  # free queue starts in block-id order
        self.holders: list[list[KVCacheBlock]] = []
        self.num_hashes = 0

    @precondition(lambda self: self.pool.get_num_free_blocks() > 0)
    @rule(data=st.data())
    def allocate(self, data) -> None:
        n = data.draw(st.integers(1, self.pool.get_num_free_blocks()))
        expected, self.model_free = self.model_free[:n], self.model_free[n:]
        evicted = [self.pool.blocks[i].block_hash for i in expected]
        blocks = self.pool.get_new_blocks(n)
        assert [b.block_id for b in blocks] == expected  # popped from the head
        assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)
        assert all(self.pool.get_cached_block(h) is None for h in evicted if h is not None)
        self.holders.append(blocks)

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), duplicate=st.booleans())
    def cache(self, data, duplicate: bool) -> None:
        blocks = data.draw(st.sampled_from(self.holders))
        end = data.draw(st.integers(0, len(blocks)))
        known = list(self.pool.cached_block_hash_to_block)
        hashes = []
        for _ in range(len(blocks)):
            if duplicate and known:
                hashes.append(data.draw(st.sampled_from(known)))
            else:
                self.num_hashes += 1
                hashes.append(b"h%d" % self.num_hashes)
        before = {b.block_id: b.block_hash for b in blocks}
        taken = set(known)
        self.pool.cache_full_blocks(blocks, hashes, 0, end)
        for i, b in enumerate(blocks):
            if i >= end or before[b.block_id] is not None or hashes[i] in taken:
                assert b.block_hash == before[b.block_id]  # hashed blocks keep their hash
            else:
                assert b.block_hash == hashes[i]
                taken.add(hashes[i])

    @precondition(lambda self: self.pool.cached_block_hash_to_block)
    @rule(data=st.data())
    def hit(self, data) -> None:
        block_hash = data.draw(st.sampled_from(sorted(self.pool.cached_block_hash_to_block)))
        block = self.pool.get_cached_block(block_hash)
        if block.ref_cnt == 0:
            self.model_free.remove(block.block_id)
        self.pool.touch([block])
        self.holders.append([block])

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), reverse=st.booleans())
    def free(self, data, reverse: bool) -> None:
        blocks = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        order = list(reversed(blocks)) if reverse else blocks
        for b in order:  # the model: unhashed to the head, hashed to the tail
            if b.ref_cnt == 1:
                if b.block_hash is None:
                    self.model_free.insert(0, b.block_id)
                else:
                    self.model_free.append(b.block_id)
        self.pool.free_blocks(order)

    @invariant()
    def pool_matches_model(self) -> None:
        self.pool.check_integrity()
        assert [b.block_id for b in self.pool.free_block_queue] == self.model_free
        holders = Counter(b.block_id for blocks in self.holders for b in blocks)
        for b in self.pool.blocks:
            assert b.ref_cnt == holders[b.block_id]
            assert b.ref_cnt <= 1 or b.block_hash is not None  # only hashed blocks are shared
        num_held = sum(1 for b in self.pool.blocks if b.ref_cnt > 0)
        assert num_held + self.pool.get_num_free_blocks() == NUM_BLOCKS
        assert self.pool.get_usage() == num_held / NUM_BLOCKS
        cached_free = [i for i in self.model_free if self.pool.blocks[i].block_hash is not None]
        assert self.pool.get_num_cached_free_blocks() == len(cached_free)

    def teardown(self) -> None:
        while self.holders:
            self.pool.free_blocks(self.holders.pop())
        self.pool.check_integrity()
        assert self.pool.get_num_free_blocks() == NUM_BLOCKS and self.pool.get_usage() == 0.0


BlockPoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_block_pool_against_model = BlockPoolMachine.TestCase
