"""KV cache groups: the layout plan, and the manager with a full and sliding-window groups
driven like a scheduler (property-based): no leaks, no block returned while a layer of its
request can still read it, every block wholly behind the window returned, prefix hits only on
blocks that still hold the tokens they claim, check_integrity() after every operation."""

from __future__ import annotations

from conftest import make_request
from hypothesis import settings
from kv_driver import KVCacheDriver

from engine.core.kv_cache_groups import (
    KVCacheSpec,
    max_blocks_per_request,
    plan_kv_groups,
)
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import RequestStatus


# ---- layout ---------------------------------------------------------------------------------
def test_plan_gemma3_like_mix_into_equal_groups():
    windows = [512 if (i + 1) % 6 else 0 for i in range(18)]  # Gemma 3 270M: 15 local, 3 global
    spec = plan_kv_groups(windows)
    assert spec.windows == (0, 512, 512, 512, 512, 512)
    assert spec.layer_groups[0] == (5, 11, 17) and spec.num_slots == 3
    placement = spec.group_and_slot()
    assert sorted(placement) == list(range(18))
    # every slot holds exactly one layer of every group
    for slot in range(3):
        assert len({g for g, s in placement.values() if s == slot}) == 6


def test_plan_pads_least_then_fewest_groups():
    assert plan_kv_groups([0, 0, 0]) == KVCacheSpec((0,), ((0, 1, 2),))
    assert plan_kv_groups([8, 8]) == KVCacheSpec((8,), ((0, 1),))
    alternating = plan_kv_groups([8, 0, 8, 0])  # Gemma 2: two groups of two
    assert alternating == KVCacheSpec((0, 8), ((1, 3), (0, 2)))
    # 2 global, 3 local: size 1 pads nothing (5 groups); size 2 would pad one slot
    assert plan_kv_groups([8, 8, 0, 8, 0]).num_slots == 1
    assert not plan_kv_groups([0, 0]).is_hybrid and plan_kv_groups([8]).is_hybrid


def test_sliding_need_stops_at_the_window():
    # window 8, block 4, chunk 8: keys of one step span 8 + 8 - 1 = 15 tokens -> <= 5 blocks
    assert max_blocks_per_request((8,), 4, 10_000, 8) == 5
    assert max_blocks_per_request((8,), 4, 6, 8) == 2  # never more than the tokens need
    assert max_blocks_per_request((0, 8), 4, 100, 1) == 25 + 3


def test_sliding_blocks_return_as_decoding_advances():
    kv = KVCacheManager(num_blocks=8, block_size=4, group_windows=(8,))
    req = make_request("a", 12)
    assert len(kv.allocate_slots(req, 12)) == 3
    req.num_computed_tokens = 12
    for token in range(20):
        req.all_token_ids.append(token)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        c = req.num_computed_tokens - 1  # the query just scheduled sees keys c - 7 .. c
        blocks = kv.req_to_blocks["a"]
        first_visible = (c - 8 + 1) // 4
        assert all(b is None for b in blocks[:first_visible])
        assert all(b is not None for b in blocks[first_visible:])
        kv.check_integrity()
    assert kv.get_num_held_blocks("a") <= 3
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == 8
    kv.check_integrity()


def test_a_sliding_hit_needs_only_the_last_window():
    kv = KVCacheManager(num_blocks=16, block_size=4, group_windows=(0, 6))
    first = make_request("first", 24)
    kv.allocate_slots(first, 24)
    first.num_computed_tokens = 24
    first.status = RequestStatus.FINISHED_STOPPED
    kv.free(first)
    again = make_request("again", 25)
    (full_hits, sliding_hits), num_hit = kv.get_computed_blocks(again)
    assert num_hit == 24 and len(full_hits) == len(sliding_hits) == 6
    # a query at 24 with window 6 sees keys 19..24: blocks 4 and 5 only
    assert sliding_hits[:4] == [None] * 4 and None not in sliding_hits[4:]
    assert kv.allocate_slots(again, 1, [full_hits, sliding_hits], num_hit) is not None
    kv.check_integrity()
    assert kv.get_block_ids("again", 1)[:4] == [0] * 4  # placeholders


def test_a_sliding_hit_is_cut_where_the_window_is_missing():
    kv = KVCacheManager(num_blocks=6, block_size=4, group_windows=(5,))
    first = make_request("first", 16)
    chain = kv.allocate_slots(first, 16)  # 4 blocks, all hashed
    first.status = RequestStatus.FINISHED_STOPPED
    kv.free(first)  # tail first: block 3 is the first cached block to be evicted
    filler = make_request("filler", 12, start=100)  # the 2 empty blocks, then block 3
    assert kv.allocate_slots(filler, 12)[2] is chain[3]
    again = make_request("again", 17)
    hits, num_hit = kv.get_computed_blocks(again)
    # a 16-token hit needs keys 12..15 (block 3: gone); a 12-token hit, the query at 12 with
    # window 5 seeing keys 8..12, needs block 2 only (cached)
    assert num_hit == 12 and hits == [None, None, chain[2]]


# ---- property-based (tests/kv_driver.py) -----------------------------------------------------
class HybridKVMachine(KVCacheDriver):
    WINDOWS = (0, 6)  # Gemma 2's kinds: a full group and a sliding one
    NUM_BLOCKS = 12


class SlidingOnlyMachine(KVCacheDriver):
    WINDOWS = (5,)  # Mistral: one sliding group, a window that is no multiple of the block
    NUM_BLOCKS = 7


class ThreeGroupMachine(KVCacheDriver):
    WINDOWS = (0, 6, 6)  # Gemma 3's layout: a full group and two groups of one window
    NUM_BLOCKS = 14


_SETTINGS = settings(max_examples=80, stateful_step_count=50, deadline=None)
for _machine in (HybridKVMachine, SlidingOnlyMachine, ThreeGroupMachine):
    _machine.TestCase.settings = _SETTINGS
test_full_and_sliding_groups = HybridKVMachine.TestCase
test_sliding_group_alone = SlidingOnlyMachine.TestCase
test_full_and_two_sliding_groups = ThreeGroupMachine.TestCase
