"""A live view of the paged KV cache for the playground and its API (no torch, no FastAPI).

The engine thread owns the block pool, so the view copies what it needs there, between steps,
as a few flat arrays: the running requests' block tables (int32 copies kept up to date
incrementally, so a capture converts only the ids added since the previous one), the pool's
one-byte-per-block hash tags and some counters. Ref counts are not read block by block: every
held block's ref count equals the number of running requests whose table holds it
(`KVCacheManager.check_integrity`), so readers rebuild them from the tables, off the engine
thread (server/kv_api.py). `bench/kv_view.py` measures the copy and the step loop with
and without a subscriber.

    engine thread:  step -> on_step(stats) --(due and wanted)--> take_snapshot -> callbacks
    event loop:     subscribe(callback) ... callback(snapshot) ... unsubscribe(token)

Captures happen only while someone subscribes, at most `max_updates_per_s` times a second; a
change the rate held back is captured when the engine goes idle (`idle_timeout`).

KV cache groups (engine/core/kv_cache_groups.py): each request has one table per group. A copy
holds SKIPPED_BLOCK_ID where the engine's table has a placeholder (a sliding group's block
that slid out of the window and went back to the pool), so readers never mistake it for
block 0. Placeholders are a leading run of a table, so each copy only scans from where the
previous capture's run ended.
"""

from __future__ import annotations

import itertools
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.core.kv_marks import live_cow_blocks, live_tier_blocks, swap_marks
from engine.core.scheduler import Scheduler

MAX_UPDATES_PER_S = 10.0
MAX_WAITING_LISTED = 64  # a snapshot names the head of the waiting queue, not all of it
SKIPPED_BLOCK_ID = -1  # a table entry whose block slid out of the window (not held)


class RequestBlocks(NamedTuple):  # a tuple: built 256 times per capture, cheaply
    """One running request as the KV cache sees it: logical block i -> block_table[i]."""

    request_id: str
    block_table: array  # of int32 ('i'), this snapshot's own copy
    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hit when it was first scheduled
    num_preemptions: int
    # One table per KV cache group, block_tables[0] is block_table; () with a single group.
    block_tables: tuple[array, ...] = ()
    forked: bool = False  # shares blocks through a fork (n > 1 sibling or beam), until freed
    mm_spans: tuple = ()  # (start, length, content hash) of each image's placeholder tokens

    @property
    def tables(self) -> tuple[array, ...]:
        return self.block_tables or (self.block_table,)


@dataclass(frozen=True)
class KVSnapshot:
    """Copies, never live engine state: safe to read on any thread."""

    seq: int
    time: float  # wall clock, seconds since the epoch
    num_blocks: int
    block_size: int
    hash_tags: bytes  # per block: 0 without a prefix-cache hash, else a tag that changes with it
    requests: list[RequestBlocks]
    waiting: list[tuple[str, int]]  # (request_id, num_preemptions) of the queue's head
    num_waiting: int
    num_free_blocks: int  # ref count 0, cached or not
    num_cached_free_blocks: int  # ref count 0 and hashed: evictable prefix-cache blocks
    num_preemptions_total: int
    num_evictions_total: int
    prefix_cache_queries_total: int  # tokens looked up
    prefix_cache_hits_total: int  # tokens found
    group_windows: tuple[int, ...] = (0,)  # per KV cache group: 0 full attention, else W
    hash_groups: bytes = b""  # per block: the group of its prefix-cache hash; b"": all group 0
    num_window_freed_blocks_total: tuple[int, ...] = ()  # per group, sliding groups only > 0
    # engine/core/kv_marks.py: blocks a copy-on-write made / the KV tier loaded, still so
    cow_blocks: tuple[int, ...] = ()
    tier_blocks: tuple[int, ...] = ()
    tier_loading: tuple[str, ...] = ()  # requests waiting for their prefix to load from the tier
    num_forks_total: int = 0
    num_cow_copies_total: int = 0
    kv_tier_hit_tokens_total: int = 0
    kv_tier_queries_total: int = 0  # -1: no tier
    # swap preemption (engine/core/kv_swap.py): (request id, state, blocks) of requests swapped
    # out (state out, loading or ready), and (preemptions swapped, blocks out, blocks in)
    swapped_out: tuple[tuple[str, str, int], ...] = ()
    kv_swap_totals: tuple[int, int, int] = (0, 0, 0)


@dataclass
class _Totals:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class BlockTableCopies:
    """array('i') copies of the running requests' block tables, extended as tables grow.

    Copying a list of Python ints touches every int object (its ref count), which is what a
    capture of 100k held blocks would spend its time on. Tables only grow while a request
    runs, so each capture converts just the new tail and hands the snapshot a memcpy. A sliding
    group's table also turns its leading entries into placeholders as the window moves: the
    copy marks them SKIPPED_BLOCK_ID, scanning only past the run it marked last time.
    """

    def __init__(self) -> None:
        self._copies: dict[tuple, array] = {}
        self._num_skipped: dict[tuple, int] = {}
        # the copy last handed out per table: snapshots never write to it, so an unchanged
        # table (most of them between two captures) is handed out again without a copy
        self._handed: dict[tuple, array] = {}

    def copy(
        self,
        request_id: str,
        num_preemptions: int,
        live: list[int],
        group: int = 0,
        blocks: list | None = None,
    ) -> array:
        """A table changes other than by appending only when it is freed (preemption, which
        counts in num_preemptions, or the end), when a copy-on-write replaces the entry being
        written (the last one copied), or, given `blocks` (the group's blocks, None where slid
        out), where its leading entries slide out; (id, num_preemptions, group) names one
        history."""
        key = (request_id, num_preemptions) if group == 0 else (request_id, num_preemptions, group)
        arr = self._copies.get(key)
        if arr is None:
            arr = self._copies[key] = array("i")
        n = len(arr)
        # A copy-on-write (after a fork) replaces the entry being written: the last one copied.
        changed = bool(n) and n <= len(live) and arr[n - 1] not in (live[n - 1], SKIPPED_BLOCK_ID)
        if changed:
            arr[n - 1] = live[n - 1]
        if len(live) > n:
            arr.extend(live[n:])
            changed = True
        if blocks is not None:
            done = end = self._num_skipped.get(key, 0)
            while end < len(blocks) and blocks[end] is None:
                end += 1
            if end > done:
                arr[done:end] = array("i", [SKIPPED_BLOCK_ID]) * (end - done)
                self._num_skipped[key] = end
                changed = True
        handed = self._handed.get(key)
        if changed or handed is None:
            handed = self._handed[key] = arr[:]
        return handed

    def retain(self, keys: set[tuple[str, int]]) -> None:
        for key in [k for k in self._copies if k[:2] not in keys]:
            del self._copies[key]
            self._num_skipped.pop(key, None)
            self._handed.pop(key, None)


def take_snapshot(
    scheduler: Scheduler,
    seq: int = 0,
    totals: _Totals | None = None,
    tables: BlockTableCopies | None = None,
) -> KVSnapshot:
    """Engine thread only, between steps: O(running requests x groups) plus the block ids added
    or slid out since the previous capture with the same `tables`, and a memcpy or two."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    tables = tables or BlockTableCopies()
    groups = kv.groups
    requests = _hybrid_requests(scheduler, tables) if len(groups) > 1 else _requests(
        scheduler, tables
    )
    waiting = [
        (r.request_id, r.num_preemptions)
        for r in itertools.islice(scheduler.waiting, MAX_WAITING_LISTED)
    ]
    if len(requests) * len(groups) != len(tables._copies):
        tables.retain({(r.request_id, r.num_preemptions) for r in requests})
    totals = totals or _Totals()
    hybrid = kv.is_hybrid
    tier = scheduler.kv_tier
    return KVSnapshot(
        seq=seq,
        time=time.time(),
        num_blocks=pool.num_blocks,
        block_size=kv.block_size,
        hash_tags=bytes(pool.hash_tags),
        requests=requests,
        waiting=waiting,
        num_waiting=len(scheduler.waiting),
        num_free_blocks=pool.get_num_free_blocks(),
        num_cached_free_blocks=pool.get_num_cached_free_blocks(),
        num_preemptions_total=scheduler.num_preemptions_total,
        num_evictions_total=pool.num_evictions_total,
        prefix_cache_queries_total=totals.prefix_cache_queries,
        prefix_cache_hits_total=totals.prefix_cache_hits,
        group_windows=tuple(g.window for g in groups),
        hash_groups=bytes(groups[0].hash_groups) if len(groups) > 1 else b"",
        num_window_freed_blocks_total=(
            tuple(g.num_window_freed_blocks_total for g in groups) if hybrid else ()
        ),
        cow_blocks=live_cow_blocks(groups, kv.cow_log),
        tier_blocks=live_tier_blocks(pool, tier.load_log) if tier is not None else (),
        tier_loading=tuple(itertools.islice(tier.loading, MAX_WAITING_LISTED)) if tier else (),
        num_forks_total=scheduler.num_forks_total,
        num_cow_copies_total=kv.num_cow_copies_total,
        kv_tier_hit_tokens_total=tier.hit_tokens_total if tier is not None else 0,
        kv_tier_queries_total=tier.queries_total if tier is not None else -1,
        **swap_marks(scheduler.kv_swap),
    )


def _requests(scheduler: Scheduler, tables: BlockTableCopies) -> list[RequestBlocks]:
    """One group: the table copy alone (its placeholders marked when that group slides)."""
    kv = scheduler.kv_cache_manager
    get_block_ids, copy = kv.get_block_ids, tables.copy
    sliding = kv.groups[0].window > 0
    to_blocks = kv.groups[0].req_to_blocks
    forked = kv.fork_members
    return [
        RequestBlocks(
            r.request_id,
            copy(
                r.request_id,
                r.num_preemptions,
                get_block_ids(r.request_id),
                0,
                to_blocks.get(r.request_id, ()) if sliding else None,
            ),
            r.num_computed_tokens,
            r.num_tokens,
            r.num_prompt_tokens,
            max(r.num_cached_tokens, 0),
            r.num_preemptions,
            (),
            bool(forked) and r.request_id in forked,
            tuple(r.mm_spans) if r.mm_spans else (),
        )
        for r in scheduler.running
    ]


def _hybrid_requests(scheduler: Scheduler, tables: BlockTableCopies) -> list[RequestBlocks]:
    """Several groups: one copy per group, sliding ones with their placeholders marked."""
    groups = scheduler.kv_cache_manager.groups
    forked = scheduler.kv_cache_manager.fork_members
    copy = tables.copy
    out = []
    for r in scheduler.running:
        rid, num_preemptions = r.request_id, r.num_preemptions
        per_group = tuple(
            copy(
                rid,
                num_preemptions,
                g.req_to_block_ids.get(rid, ()),
                g.index,
                g.req_to_blocks.get(rid, ()) if g.window else None,
            )
            for g in groups
        )
        out.append(
            RequestBlocks(
                rid,
                per_group[0],
                r.num_computed_tokens,
                r.num_tokens,
                r.num_prompt_tokens,
                max(r.num_cached_tokens, 0),
                num_preemptions,
                per_group,
                rid in forked,
                tuple(r.mm_spans) if r.mm_spans else (),
            )
        )
    return out


@dataclass
class _Subscriber:
    callback: Callable[[KVSnapshot], None]  # called on the engine thread: hand off, never block


@dataclass
class KVView:
    """Rate-bounded snapshots for subscribers. Engine-thread methods are marked as such."""

    scheduler: Scheduler
    max_updates_per_s: float = MAX_UPDATES_PER_S
    wake: Callable[[], None] = lambda: None  # makes an idle engine loop come round
    _subscribers: dict[int, _Subscriber] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: itertools.count = field(default_factory=itertools.count)
    _totals: _Totals = field(default_factory=_Totals)
    _tables: BlockTableCopies = field(default_factory=BlockTableCopies)
    _seq: int = 0
    _next_due: float = 0.0
    _dirty: bool = True
    _last_fingerprint: tuple = ()

    # ---- any thread ------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[KVSnapshot], None]) -> int:
        """callback(snapshot) runs on the engine thread at every capture until unsubscribe."""
        with self._lock:
            token = next(self._ids)
            self._subscribers[token] = _Subscriber(callback)
            self._dirty = True  # a new subscriber gets a capture even from an idle engine
        self.wake()
        return token

    def unsubscribe(self, token: int) -> None:
        with self._lock:
            self._subscribers.pop(token, None)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    # ---- engine thread ---------------------------------------------------------------------
    def on_step(self, prefix_cache_queries: int, prefix_cache_hits: int) -> None:
        """After every step: a few additions, and a capture when one is due and wanted."""
        self._totals.prefix_cache_queries += prefix_cache_queries
        self._totals.prefix_cache_hits += prefix_cache_hits
        if not self._subscribers:
            return
        if time.monotonic() >= self._next_due:
            self._capture()
        else:
            self._dirty = True

    def on_idle(self) -> None:
        """Each idle loop turn: publish what changed since the last capture (aborts included)."""
        if not self._subscribers:
            return
        if not self._dirty and self._fingerprint() != self._last_fingerprint:
            self._dirty = True
        if self._dirty and time.monotonic() >= self._next_due:
            self._capture()

    def idle_timeout(self, default: float) -> float:
        """How long an idle loop may block before on_idle has a held-back change to publish."""
        if self._subscribers and self._dirty:
            return min(default, max(self._next_due - time.monotonic(), 0.0))
        return default

    def capture_now(self) -> KVSnapshot:
        """A snapshot outside the rate (tests, benchmarks); subscribers are not called."""
        self._seq += 1
        return take_snapshot(self.scheduler, self._seq, self._totals, self._tables)

    def _fingerprint(self) -> tuple:
        pool = self.scheduler.kv_cache_manager.block_pool
        num_free = pool.get_num_free_blocks()
        return (
            num_free,
            pool.get_num_cached_free_blocks(),
            len(self.scheduler.running),
            len(self.scheduler.waiting),
        )

    def _capture(self) -> None:
        snapshot = self.capture_now()
        self._dirty = False
        self._last_fingerprint = self._fingerprint()
        self._next_due = time.monotonic() + 1.0 / self.max_updates_per_s
        with self._lock:
            subscribers = list(self._subscribers.values())
        for sub in subscribers:
            sub.callback(snapshot)
