"""KVCacheManager: allocate_slots, None without side effects, prefix hits, reverse free."""

from __future__ import annotations

from conftest import make_request
from hypothesis import settings
from kv_driver import KVCacheDriver

from engine.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from engine.core.request import RequestStatus


def test_allocate_on_demand_and_free():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", 10)
    assert len(kv.allocate_slots(req, 10)) == 3  # ceil(10 / 4)
    req.num_computed_tokens = 10
    req.all_token_ids.append(1)
    req.all_token_ids.append(2)  # 12 tokens: still 3 blocks
    assert kv.allocate_slots(req, 2) == []
    req.num_computed_tokens = 12
    req.all_token_ids.append(3)
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


def test_extra_keys_separate_identical_tokens():
    """A salt (adapter identity) splits every block; an image's hash splits the blocks its
    placeholder tokens touch and the chain after them, never the blocks before."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    _finish_after(kv, make_request("base", 13))
    salted = make_request("salted", 13)
    salted.cache_salt = "tenant-a"
    assert kv.get_computed_blocks(salted)[1] == 0
    image = make_request("image", 13)
    image.mm_spans = [(5, 2, b"img-1")]  # tokens 5..6: the second block
    assert kv.get_computed_blocks(image)[1] == 4
    _finish_after(kv, image)
    same = make_request("same-image", 13)
    same.mm_spans = [(5, 2, b"img-1")]
    assert kv.get_computed_blocks(same)[1] == 12
    other = make_request("other-image", 13)
    other.mm_spans = [(5, 2, b"img-2")]
    assert kv.get_computed_blocks(other)[1] == 4


def _finish_after(kv: KVCacheManager, req) -> None:
    kv.allocate_slots(req, req.num_tokens)
    _finish(kv, req)


def _finish(kv: KVCacheManager, req) -> None:
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)


def test_free_releases_a_chain_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", 14)  # 3 full blocks + a partial one
    blocks = kv.allocate_slots(req, 14)
    req.num_computed_tokens = 14
    _finish(kv, req)
    order = [b.block_id for b in kv.block_pool.free_block_queue]
    partial, *full = blocks[::-1]
    # The unhashed partial block is reused first; the full chain sits tail-first behind it.
    assert order[0] == partial.block_id
    assert order[-3:] == [b.block_id for b in full]
    other = make_request("other", 8, start=100)  # unrelated: unhashed blocks go before cached
    taken = kv.allocate_slots(other, 8)
    assert taken[0] is partial and taken[1].block_id == 4  # never used, so never hashed
    _finish(kv, other)
    kv.check_integrity()


def test_evicting_the_tail_keeps_the_head_of_the_chain_hittable():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request("a", 13)  # 3 full blocks + 1 token: the whole pool
    chain = kv.allocate_slots(req, 13)[:3]
    _finish(kv, req)
    filler = make_request("filler", 8, start=100)  # needs 2: the partial, then the chain's tail
    tail_hash = chain[2].block_hash
    assert kv.allocate_slots(filler, 8)[1] is chain[2]
    assert kv.block_pool.get_cached_block(tail_hash) is None
    _finish(kv, filler)
    again = make_request("again", 13)
    hits, num_hit = kv.get_computed_blocks(again)
    assert hits == chain[:2] and num_hit == 8
    kv.check_integrity()


def test_a_hit_on_free_blocks_counts_against_the_free_pool():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    first = make_request("first", 12)
    kv.allocate_slots(first, 12)
    _finish(kv, first)  # 3 cached free blocks + 1 empty
    too_long = make_request("too_long", 20)  # hits 3 blocks, needs 2 more: only 1 is not a hit
    hits, num_hit = kv.get_computed_blocks(too_long)
    assert num_hit == 12 and kv.allocate_slots(too_long, 8, hits, num_hit) is None
    second = make_request("second", 16)  # hits 3 blocks (12 tokens), needs 1 more: fits exactly
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 12
    assert kv.allocate_slots(second, 4, hits, num_hit) is not None
    kv.check_integrity()
    third = make_request("third", 13)  # hits the same 3 blocks (held now) and needs 1: none left
    hits, num_hit = kv.get_computed_blocks(third)
    assert num_hit == 12 and kv.allocate_slots(third, 1, hits, num_hit) is None


def test_prefix_stats_count_a_request_once_when_admitted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    hog = make_request("hog", 16, start=100)
    kv.allocate_slots(hog, 16)
    waiting = make_request("waiting", 9)
    for _ in range(3):  # looked up every step while the pool is short: not a query yet
        hits, num_hit = kv.get_computed_blocks(waiting)
        assert kv.allocate_slots(waiting, 9 - num_hit, hits, num_hit) is None
    stats = kv.take_prefix_cache_stats()
    assert (stats.num_queries, stats.num_hits) == (0, 0)
    _finish(kv, hog)
    hits, num_hit = kv.get_computed_blocks(waiting)
    assert kv.allocate_slots(waiting, 9 - num_hit, hits, num_hit) is not None
    stats = kv.take_prefix_cache_stats()
    assert (stats.num_queries, stats.num_hits) == (9, 0)
    repeat = make_request("repeat", 9)
    hits, num_hit = kv.get_computed_blocks(repeat)
    kv.allocate_slots(repeat, 9 - num_hit, hits, num_hit)
    stats = kv.take_prefix_cache_stats()
    assert (stats.num_queries, stats.num_hits) == (9, 8)


def test_interleaved_lookups_each_count_once_admitted():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request("a", 9), make_request("b", 5, start=50)
    looked_up = [(r, *kv.get_computed_blocks(r)) for r in (a, b)]
    for req, hits, num_hit in reversed(looked_up):
        kv.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit)
    stats = kv.take_prefix_cache_stats()
    assert (stats.num_queries, stats.num_hits) == (14, 0)


def test_prefix_caching_off_never_hashes_or_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a = make_request("a", 9)
    kv.allocate_slots(a, 9)
    _finish(kv, a)
    b = make_request("b", 9)
    assert kv.get_computed_blocks(b) == ([], 0)
    assert not kv.block_pool.cached_block_hash_to_block and not kv.req_to_block_hashes
    stats = kv.take_prefix_cache_stats()
    assert (stats.num_queries, stats.num_hits) == (0, 0)


# ---- property-based: a scheduler-like driver over random requests (tests/kv_driver.py) -------
class KVCacheManagerMachine(KVCacheDriver):
    WINDOWS = (0,)
    NUM_BLOCKS = 6  # small, so allocate_slots fails, preempts and evicts often


KVCacheManagerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
test_kv_cache_manager_against_model = KVCacheManagerMachine.TestCase
