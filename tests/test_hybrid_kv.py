"""KV cache groups: the layout plan, and the manager with a full and sliding-window groups
driven like a scheduler (property-based): no leaks, no block returned while a layer of its
request can still read it, every block wholly behind the window returned, prefix hits only on
blocks that still hold the tokens they claim, check_integrity() after every operation."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import make_request
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv_cache_groups import (
    KVCacheSpec,
    cdiv,
    max_blocks_per_request,
    plan_kv_groups,
)
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


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


# ---- property-based -------------------------------------------------------------------------
BS = 4
PREFIXES = [[], [1, 2, 0, 1, 2, 0], [2, 2, 1, 0, 0, 1, 2, 1, 1, 0, 2]]


class HybridKVMachine(RuleBasedStateMachine):
    """A scheduler-like driver over a manager with several groups (WINDOWS), checking the books
    and what every layer of every request can still read after each operation."""

    WINDOWS: tuple[int, ...] = (0, 6)
    NUM_BLOCKS = 12

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, BS, group_windows=self.WINDOWS)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.history: list[list[int]] = []
        # block id -> (group, the token prefix its KV encodes); dropped when the block is reused
        self.content: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.num_requests = 0
        self.expected_stats = [0, 0]

    def _skipped(self, group: int, num_computed: int) -> int:
        window = self.WINDOWS[group]
        return max(num_computed - window + 1, 0) // BS if window else 0

    def _new_request(self, tokens: list[int]) -> None:
        self.num_requests += 1
        sp = SamplingParams(temperature=0.0, max_tokens=64)
        self.waiting.append(Request(f"r{self.num_requests}", tokens or [0], sp))

    @initialize(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 2), max_size=12))
    def first_request(self, prefix: list[int], suffix: list[int]) -> None:
        self.add_request(prefix, suffix)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 2), max_size=12))
    def add_request(self, prefix: list[int], suffix: list[int]) -> None:
        self._new_request(prefix + suffix)
        self.history.append(prefix + suffix)

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def add_repeat(self, data) -> None:
        self._new_request(list(data.draw(st.sampled_from(self.history))))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def admit(self, data, chunk: int) -> None:
        req = data.draw(st.sampled_from(self.waiting))
        hits, num_hit = self.kv.get_computed_blocks(req)
        per_group = hits if len(self.WINDOWS) > 1 else [hits]
        assert num_hit % BS == 0 and num_hit <= req.num_tokens - 1
        event("hit" if num_hit else "miss")
        for g, group_hits in enumerate(per_group):
            assert len(group_hits) == num_hit // BS
            first = self._skipped(g, num_hit)
            assert all(b is None for b in group_hits[:first])
            for i in range(first, len(group_hits)):  # the window is there, with the right KV
                block = group_hits[i]
                assert block is not None
                want = (g, tuple(req.all_token_ids[: (i + 1) * BS]))
                assert self.content.get(block.block_id) == want, "a hit on rewritten KV"
            if first:
                event("a sliding hit past the window")
        num_new = min(chunk, req.num_tokens - num_hit)
        if self._allocate(req, num_new, hits, num_hit):
            self.expected_stats[0] += req.num_tokens
            self.expected_stats[1] += num_hit
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 24), token=st.integers(0, 2))
    def step(self, data, chunk: int, token: int) -> None:
        req = data.draw(st.sampled_from(self.running))
        if req.num_computed_tokens == req.num_tokens:
            req.all_token_ids.append(token)
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        if not self._allocate(req, num_new, None, 0):
            self._preempt(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        self._preempt(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        req = data.draw(st.sampled_from(self.running))
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self.kv.free(req)
        assert req.request_id not in self.kv.req_to_block_hashes

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data) -> None:
        req = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        self.kv.free(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.insert(0, req)

    def _allocate(self, req: Request, num_new: int, hits, num_hit: int) -> bool:
        kv, rid = self.kv, req.request_id
        start = req.num_computed_tokens + num_hit
        for group in kv.groups:  # what allocate_slots does first (idempotent), to snapshot after
            group.remove_skipped_blocks(rid, req.num_computed_tokens)
        per_group = (hits if len(self.WINDOWS) > 1 else [hits]) if hits else [[]] * len(kv.groups)
        num_needed = 0
        for group, group_hits in zip(kv.groups, per_group):
            held = len(group.req_to_blocks.get(rid, []))
            num_needed += max(cdiv(start + num_new, BS) - held - len(group_hits), 0)
        evictable = sum(1 for h in per_group for b in h if b is not None and b.ref_cnt == 0)
        num_available = kv.block_pool.get_num_free_blocks() - evictable
        before = _snapshot(kv)
        new_blocks = kv.allocate_slots(req, num_new, hits, num_hit)
        if new_blocks is None:
            event("allocate_slots failed")
            assert num_needed > num_available, "allocate_slots failed with room to spare"
            assert _snapshot(kv) == before, "a failed allocate_slots changed state"
            return False
        assert len(new_blocks) == num_needed
        for b in new_blocks:
            self.content.pop(b.block_id, None)  # reused: its old KV is gone
        end = start + num_new
        req.num_computed_tokens = end
        for g, group in enumerate(kv.groups):
            blocks = group.req_to_blocks[rid]
            assert len(blocks) == cdiv(end, BS)
            # every block a query of this step reads is held; everything before is returned
            first = self._skipped(g, start)
            assert all(b is None for b in blocks[:first]), "a dead block kept"
            assert all(b is not None and b.ref_cnt > 0 for b in blocks[first:]), "read, not held"
            for i in range(start // BS, end // BS):  # blocks filled this step
                self.content[blocks[i].block_id] = (g, tuple(req.all_token_ids[: (i + 1) * BS]))
        return True

    @invariant()
    def books_balance(self) -> None:
        kv = self.kv
        kv.check_integrity()
        holders: Counter[int] = Counter()
        for group in kv.groups:
            assert set(group.req_to_blocks) == {r.request_id for r in self.running}
            for r in self.running:
                blocks = group.req_to_blocks[r.request_id]
                holders.update(b.block_id for b in blocks if b is not None)
                # a future query (at num_computed or later) can read these: they must be held
                first = self._skipped(group.index, r.num_computed_tokens)
                assert all(b is not None for b in blocks[first:])
        for b in kv.block_pool.blocks:
            assert b.ref_cnt == holders[b.block_id]
        assert len(holders) + kv.block_pool.get_num_free_blocks() == self.NUM_BLOCKS
        used = 1 - kv.block_pool.get_num_free_blocks() / self.NUM_BLOCKS
        assert kv.usage == pytest.approx(used)

    def teardown(self) -> None:
        for req in self.running + self.waiting:
            req.status = RequestStatus.FINISHED_ABORTED
            self.kv.free(req)
        kv = self.kv
        kv.check_integrity()
        assert kv.block_pool.get_num_free_blocks() == self.NUM_BLOCKS and kv.usage == 0.0
        for group in kv.groups:
            assert not group.req_to_blocks and not group.req_to_block_ids
            assert not group.num_cached_blocks
        assert not kv.req_to_block_hashes and not kv._pending_queries
        stats = kv.take_prefix_cache_stats()
        assert [stats.num_queries, stats.num_hits] == self.expected_stats


def _snapshot(kv: KVCacheManager):
    pool = kv.block_pool
    return (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue],
        {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
        pool.num_cached_free_blocks,
        [
            (
                {rid: [b and b.block_id for b in bl] for rid, bl in g.req_to_blocks.items()},
                {rid: list(ids) for rid, ids in g.req_to_block_ids.items()},
                dict(g.num_cached_blocks),
            )
            for g in kv.groups
        ],
        {rid: list(hs) for rid, hs in kv.req_to_block_hashes.items()},
        (kv.prefix_cache_stats.num_queries, kv.prefix_cache_stats.num_hits),
        dict(kv._pending_queries),
    )


class SlidingOnlyMachine(HybridKVMachine):
    WINDOWS = (5,)  # Mistral: one sliding group, a window that is no multiple of the block
    NUM_BLOCKS = 7


class ThreeGroupMachine(HybridKVMachine):
    WINDOWS = (0, 6, 6)  # Gemma 3's layout: a full group and two groups of one window
    NUM_BLOCKS = 14


_SETTINGS = settings(max_examples=80, stateful_step_count=50, deadline=None)
for _machine in (HybridKVMachine, SlidingOnlyMachine, ThreeGroupMachine):
    _machine.TestCase.settings = _SETTINGS
test_full_and_sliding_groups = HybridKVMachine.TestCase
test_sliding_group_alone = SlidingOnlyMachine.TestCase
test_full_and_two_sliding_groups = ThreeGroupMachine.TestCase
