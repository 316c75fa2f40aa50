"""KVCacheManager: allocate_slots, None without side effects, prefix hits, reverse free."""

from __future__ import annotations

from collections import Counter

from conftest import make_request
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.kv_cache_manager import KVCacheManager, cdiv, hash_block_tokens
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


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


# ---- property-based: a scheduler-like driver over random requests --------------------------
BS = 4
NUM_BLOCKS = 6  # small, so allocate_slots fails, preempts and evicts often
# Shared prefixes (none, one and a half blocks, two and three-quarter blocks) over a 3-token
# alphabet, so identical blocks, shared prefixes and partial-block hits come up often.
PREFIXES = [[], [1, 2, 0, 1, 2, 0], [2, 2, 1, 0, 0, 1, 2, 1, 1, 0, 2]]


def snapshot(kv: KVCacheManager):
    """Everything allocate_slots could touch, by value."""
    pool = kv.block_pool
    return (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue],
        {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
        pool.num_cached_free_blocks,
        {rid: [b.block_id for b in blocks] for rid, blocks in kv.req_to_blocks.items()},
        {rid: list(ids) for rid, ids in kv.req_to_block_ids.items()},
        {rid: list(hs) for rid, hs in kv.req_to_block_hashes.items()},
        dict(kv.num_cached_blocks),
        (kv.prefix_cache_stats.num_queries, kv.prefix_cache_stats.num_hits),
        dict(kv._pending_queries),
    )


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Admit (with prefix hits), chunked prefill, decode, preempt, finish, abort: as a scheduler
    would, checking after every operation that the books balance and that a hit returns blocks
    whose KV was written for exactly the same token prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS)
        self.waiting: list = []
        self.running: list = []
        self.history: list[list[int]] = []
        self.content: dict[int, tuple[int, ...]] = {}  # block id -> the prefix its KV encodes
        self.num_requests = 0
        self.expected_stats = [0, 0]

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
        """The same prompt again (n > 1, a retry, a shared system prompt)."""
        self._new_request(list(data.draw(st.sampled_from(self.history))))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def admit(self, data, chunk: int) -> None:
        req = data.draw(st.sampled_from(self.waiting))
        hits, num_hit = self.kv.get_computed_blocks(req)
        assert num_hit == len(hits) * BS and num_hit <= req.num_tokens - 1
        event("hit" if num_hit else "miss")
        for i, block in enumerate(hits):  # never wrong KV
            assert self.content.get(block.block_id) == tuple(req.all_token_ids[: (i + 1) * BS])
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
        """Prefill the next chunk, or decode one more token; preempt it if the pool is short."""
        req = data.draw(st.sampled_from(self.running))
        if req.num_computed_tokens == req.num_tokens:
            req.all_token_ids.append(token)
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        if not self._allocate(req, num_new, [], 0):
            self._preempt(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        self._preempt(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        req = data.draw(st.sampled_from(self.running))
        held = list(self.kv.req_to_blocks[req.request_id])
        refs = [b.ref_cnt for b in held]
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self.kv.free(req)
        assert [b.ref_cnt for b in held] == [r - 1 for r in refs]
        assert req.request_id not in self.kv.req_to_block_hashes

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data) -> None:
        req = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        self.kv.free(req)

    def _preempt(self, req) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.insert(0, req)

    def _allocate(self, req, num_new: int, hits: list, num_hit: int) -> bool:
        kv, rid = self.kv, req.request_id
        start = req.num_computed_tokens + num_hit
        num_held = len(kv.req_to_blocks.get(rid, []))
        num_needed = max(cdiv(start + num_new, BS) - num_held - len(hits), 0)
        num_available = kv.block_pool.get_num_free_blocks() - sum(b.ref_cnt == 0 for b in hits)
        before = snapshot(kv)
        new_blocks = kv.allocate_slots(req, num_new, hits, num_hit)
        if new_blocks is None:
            event("allocate_slots failed")
            assert num_needed > num_available, "allocate_slots failed with room to spare"
            assert snapshot(kv) == before, "a failed allocate_slots changed state"
            return False
        assert len(new_blocks) == num_needed
        req.num_computed_tokens = start + num_new
        blocks = kv.req_to_blocks[rid]
        assert len(blocks) == cdiv(req.num_computed_tokens, BS)
        assert blocks[: len(hits)] == hits or num_held
        for b in new_blocks:
            self.content.pop(b.block_id, None)  # reused: its old KV is gone
        for i in range(start // BS, req.num_computed_tokens // BS):  # blocks filled this step
            self.content[blocks[i].block_id] = tuple(req.all_token_ids[: (i + 1) * BS])
        return True

    @invariant()
    def books_balance(self) -> None:
        kv = self.kv
        kv.check_integrity()
        holders = Counter(b.block_id for r in self.running for b in kv.req_to_blocks[r.request_id])
        assert set(kv.req_to_blocks) == {r.request_id for r in self.running}
        for b in kv.block_pool.blocks:
            assert b.ref_cnt == holders[b.block_id]
            assert b.ref_cnt <= 1 or b.block_hash is not None
        assert len(holders) + kv.block_pool.get_num_free_blocks() == NUM_BLOCKS
        if any(n > 1 for n in holders.values()):
            event("a block shared by running requests")
        for r in self.running:
            assert kv.get_block_ids(r.request_id) == [
                b.block_id for b in kv.req_to_blocks[r.request_id]
            ]

    def teardown(self) -> None:
        for req in self.running + self.waiting:
            req.status = RequestStatus.FINISHED_ABORTED
            self.kv.free(req)
        kv = self.kv
        kv.check_integrity()
        assert kv.block_pool.get_num_free_blocks() == NUM_BLOCKS and kv.usage == 0.0
        assert not kv.req_to_blocks and not kv.req_to_block_ids and not kv.req_to_block_hashes
        assert not kv.num_cached_blocks and not kv._pending_queries
        stats = kv.take_prefix_cache_stats()
        assert [stats.num_queries, stats.num_hits] == self.expected_stats


KVCacheManagerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
test_kv_cache_manager_against_model = KVCacheManagerMachine.TestCase
