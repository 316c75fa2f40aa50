"""A scheduler-like driver over a KVCacheManager (hypothesis' rule-based state machine), shared by
tests/test_kv_cache_manager.py (one full-attention group) and tests/test_hybrid_kv.py (full and
sliding-window groups): admit with prefix hits, chunked prefill, decode, preempt, finish, abort,
checking after every operation that the books balance, that a failed allocate_slots changed
nothing, that every block a layer can still read is held and every block behind its window
returned, and that a hit returns blocks whose KV was written for exactly the same prefix.

With FORKS (tests/test_kv_forks.py) it also forks running requests (copy-on-write, as n > 1
does): the driver keeps, per block slot, the token prefix whose KV the slot holds, applies the
manager's block copies, and checks after every operation that every position a request can
still read holds its own prefix's KV (no write ever landed in a block another request reads)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.core.kv_cache_groups import cdiv
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

BS = 4
PREFIXES = [[], [1, 2, 0, 1, 2, 0], [2, 2, 1, 0, 0, 1, 2, 1, 1, 0, 2]]


class KVCacheDriver(RuleBasedStateMachine):
    """Drives a manager with the groups WINDOWS (0: full attention) over NUM_BLOCKS blocks; a
    subclass picks both and is run through its TestCase."""

    WINDOWS: tuple[int, ...] = (0,)
    NUM_BLOCKS = 6
    FORKS = False

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
        # block id -> {slot: (group, token prefix whose KV the slot holds)}, with forks only
        self.slots: dict[int, dict[int, tuple[int, tuple[int, ...]]]] = {}

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
        """The same prompt again (n > 1, a retry, a shared system prompt)."""
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
        """Prefill the next chunk, or decode one more token; preempt it if the pool is short."""
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
        held = Counter(b for g in self.kv.groups for b in g.req_to_blocks[req.request_id] if b)
        refs = {b: b.ref_cnt for b in held}
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self.kv.free(req)
        assert all(b.ref_cnt == refs[b] - n for b, n in held.items())
        assert req.request_id not in self.kv.req_to_block_hashes

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data) -> None:
        req = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        self.kv.free(req)

    @precondition(lambda self: self.FORKS and any(r.num_computed_tokens for r in self.running))
    @rule(data=st.data(), recompute_last=st.booleans())
    def fork(self, data, recompute_last: bool) -> None:
        """A child sharing the parent's computed tokens' blocks; it starts at the last computed
        token (recomputing it, as the scheduler's children do) or after it."""
        parent = data.draw(st.sampled_from([r for r in self.running if r.num_computed_tokens]))
        k = parent.num_computed_tokens
        self.num_requests += 1
        child = Request(f"r{self.num_requests}", parent.all_token_ids[:k], parent.sampling_params)
        refs = {
            b: b.ref_cnt for g in self.kv.groups for b in g.req_to_blocks[parent.request_id] if b
        }
        self.kv.fork(parent, child, k)
        for g in self.kv.groups:  # every shared block gained exactly one holder
            blocks = g.req_to_blocks[child.request_id]
            assert blocks == g.req_to_blocks[parent.request_id][: cdiv(k, BS)]
        gained = Counter(b for g in self.kv.groups for b in g.req_to_blocks[child.request_id])
        assert all(b.ref_cnt == refs[b] + gained[b] for b in gained if b is not None)
        start = k - 1 if recompute_last and self._readable(child, k - 1) else k
        child.num_computed_tokens = start
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        event("fork recomputing the last token" if start < k else "fork")

    def _readable(self, req: Request, pos: int) -> bool:
        """Whether req holds every block a query at pos reads, in every group."""
        for g, group in enumerate(self.kv.groups):
            blocks = group.req_to_blocks[req.request_id]
            if any(b is None for b in blocks[self._skipped(g, pos) : cdiv(pos + 1, BS)]):
                return False
        return True

    @precondition(lambda self: self.FORKS and self.running)
    @rule()
    def preempt_all(self) -> None:
        for req in list(self.running):
            self._preempt(req)

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
        num_needed = num_copies = 0
        for group, group_hits in zip(kv.groups, per_group):
            held = len(group.req_to_blocks.get(rid, []))
            num_needed += max(cdiv(start + num_new, BS) - held - len(group_hits), 0)
            blocks = group.req_to_blocks.get(rid, [])  # shared blocks to be written: copies
            num_copies += sum(
                1
                for b in blocks[start // BS : cdiv(start + num_new, BS)]
                if b is not None and b.ref_cnt > 1
            )
        evictable = sum(1 for h in per_group for b in h if b is not None and b.ref_cnt == 0)
        num_available = kv.block_pool.get_num_free_blocks() - evictable
        before = _snapshot(kv)
        new_blocks = kv.allocate_slots(req, num_new, hits, num_hit)
        if new_blocks is None:
            event("allocate_slots failed")
            assert num_needed + num_copies > num_available, "failed with room to spare"
            assert _snapshot(kv) == before, "a failed allocate_slots changed state"
            return False
        assert len(new_blocks) == num_needed
        for b in new_blocks:
            self.content.pop(b.block_id, None)  # reused: its old KV is gone
            self.slots.pop(b.block_id, None)
        end = start + num_new
        self._run_copies(req, start, end)
        req.num_computed_tokens = end
        for g, (group, group_hits) in enumerate(zip(kv.groups, per_group)):
            blocks = group.req_to_blocks[rid]
            assert len(blocks) == cdiv(end, BS)
            # every block a query of this step reads is held; everything before is returned
            first = self._skipped(g, start)
            assert all(b is None for b in blocks[:first]), "a dead block kept"
            assert all(b is not None and b.ref_cnt > 0 for b in blocks[first:]), "read, not held"
            assert all(blocks[i] is group_hits[i] for i in range(first, len(group_hits)))
            for i in range(start // BS, end // BS):  # blocks filled this step
                self.content[blocks[i].block_id] = (g, tuple(req.all_token_ids[: (i + 1) * BS]))
        return True

    def _run_copies(self, req: Request, start: int, end: int) -> None:
        """What the runner does before the forward pass, then the step's KV writes; no write
        may land in a block anyone else holds."""
        for src, dst in self.kv.take_block_copies():
            event("copy-on-write")
            self.content.pop(dst, None)
            if src in self.content:
                self.content[dst] = self.content[src]
            self.slots[dst] = dict(self.slots.get(src, {}))
        for g, group in enumerate(self.kv.groups):
            blocks = group.req_to_blocks[req.request_id]
            for pos in range(start, end):
                block = blocks[pos // BS]
                assert block.ref_cnt == 1, f"a write into {block}, which is shared"
                prefix = (g, tuple(req.all_token_ids[: pos + 1]))
                self.slots.setdefault(block.block_id, {})[pos % BS] = prefix

    @invariant()
    def readable_kv_is_right(self) -> None:
        """Every position a running request can still read holds its own prefix's KV."""
        if not self.FORKS:
            return
        for r in self.running:
            for g, group in enumerate(self.kv.groups):
                blocks = group.req_to_blocks[r.request_id]
                first = self._skipped(g, r.num_computed_tokens)
                for pos in range(first * BS, r.num_computed_tokens):
                    slots = self.slots.get(blocks[pos // BS].block_id, {})
                    want = (g, tuple(r.all_token_ids[: pos + 1]))
                    assert slots.get(pos % BS) == want, f"{r.request_id} reads stale KV at {pos}"

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
                ids = kv.get_block_ids(r.request_id, group.index)
                assert [i for b, i in zip(blocks, ids) if b] == [b.block_id for b in blocks if b]
                assert len(ids) == len(blocks)
        for b in kv.block_pool.blocks:
            assert b.ref_cnt == holders[b.block_id]
        for r in self.running:  # only prefix hits (hashed) and forks share blocks
            if r.request_id not in kv.fork_members:
                for group in kv.groups:
                    for b in group.req_to_blocks[r.request_id]:
                        assert b is None or b.ref_cnt <= 1 or b.block_hash is not None
        if any(n > 1 for n in holders.values()):
            event("a block shared by running requests")
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
        assert not kv.cow_requests and not kv.fork_members and not kv.pending_copies
        stats = kv.take_prefix_cache_stats()
        assert [stats.num_queries, stats.num_hits] == self.expected_stats


def _snapshot(kv: KVCacheManager):
    """Everything allocate_slots could touch, by value."""
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
