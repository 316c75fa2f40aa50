"""BlockPool and its free queue: ref counts, LRU order, hash map, integrity."""

from __future__ import annotations

from engine.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


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
