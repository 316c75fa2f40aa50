"""KVCacheManager: allocate_slots, None without side effects, prefix hits, reverse free."""

from __future__ import annotations

from conftest import make_request

from engine.kv_cache_manager import KVCacheManager, hash_block_tokens
from engine.request import RequestStatus


def test_allocate_on_demand_and_free():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", 10)
    assert len(kv.allocate_slots(req, 10)) == 3  # ceil(10 / 4)
    req.num_computed_tokens = 10
    req.append_output_token(1)
    req.append_output_token(2)  # 12 tokens: still 3 blocks
    assert kv.allocate_slots(req, 2) == []
    req.num_computed_tokens = 12
    req.append_output_token(3)
    assert len(kv.allocate_slots(req, 1)) == 1
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == 10
    kv.block_pool.check_integrity()


def test_allocate_returns_none_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    big = make_request("big", 20)
    before = [(b.block_id, b.ref_cnt) for b in kv.block_pool.free_block_queue]
    assert kv.allocate_slots(big, 20) is None
    assert [(b.block_id, b.ref_cnt) for b in kv.block_pool.free_block_queue] == before
    assert "big" not in kv.req_to_blocks


def test_prefix_hit_is_capped_before_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("first", 8)
    kv.allocate_slots(first, 8)
    first.status = RequestStatus.FINISHED_STOPPED
    kv.free(first)
    same = make_request("same", 8)  # exactly two full blocks: only one may be reused
    blocks, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 4 and len(blocks) == 1
    longer = make_request("longer", 9)
    blocks, num_hit = kv.get_computed_blocks(longer)
    assert num_hit == 8 and len(blocks) == 2


def test_shared_prefix_blocks_are_ref_counted():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a, b = make_request("a", 10), make_request("b", 10)
    kv.allocate_slots(a, 10)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    kv.allocate_slots(b, 2, hits, n)
    assert [blk.ref_cnt for blk in kv.req_to_blocks["b"][:2]] == [2, 2]
    for r in (a, b):
        r.status = RequestStatus.FINISHED_STOPPED
        kv.free(r)
    assert kv.block_pool.get_num_free_blocks() == 16
    kv.block_pool.check_integrity()


def test_block_hash_is_chained():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2, 3, 4]) == h1
