"""The scheduler's side of the second KV tier (no torch): what to store, what to load, when a
request whose prefix came back from the tier may run.

- Store: every hashed block the pool evicts (BlockPool.evicted) is handed to the runner in
  SchedulerOutput.kv_stores, whose hook snapshots it before this step writes anything.
- Load: a waiting request whose prefix lookup misses the pool at block i but whose blocks
  i.. are in the tier (every KV-cache group's key of each block) leaves the waiting queue. Its
  pool hits are pinned, fresh blocks are taken for the tier blocks and their loads go out in
  SchedulerOutput.kv_loads. The request waits, holding nothing in its own tables, while other
  requests run; once every load is applied (store.applied), the loaded blocks are cached under
  their keys, everything is unpinned and the request goes back to the front of the queue, where
  the ordinary lookup now finds the whole prefix in the pool. A failed (corrupt) load leaves its
  block unhashed, so the prefix is recomputed from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.block_pool import KVCacheBlock
from engine.core.kv_event_log import describe_stored, stored_info
from engine.core.kv_marks import new_log
from engine.core.request import Request

_MAX_LOADS_PER_REQUEST = 2  # a prefix evicted again before its request runs is loaded once more


@dataclass
class _Loading:
    request: Request
    pinned: list[KVCacheBlock]  # pool hits and loaded blocks, held by the tier, table order
    loads: dict[int, tuple[KVCacheBlock, bytes, bool]] = field(default_factory=dict)
    num_done: int = 0
    aborted: bool = False


class KVTier:
    def __init__(self, manager, store) -> None:
        self.manager = manager
        self.pool = manager.block_pool
        self.store = store  # contains(key), applied: engine/kv_offload/disk_store.py
        self.pool.evicted = []
        self.loading: dict[str, _Loading] = {}  # request id -> its loads
        self._by_block: dict[int, str] = {}  # block id being loaded -> request id
        self._loads: list[tuple[int, bytes]] = []  # this step's (block id, key)
        self._num_loads: dict[str, int] = {}
        self.hit_tokens_total = 0  # prompt tokens served from the tier
        self.queries_total = 0  # prompt tokens looked up in the tier (past the pool's hit)
        self.num_failed_loads_total = 0
        self.load_log = new_log()  # recently loaded blocks, for the KV map (kv_marks.py)
        self.swap = None  # swap preemption through this tier (engine/core/kv_swap.py)

    # ---- per step ----------------------------------------------------------------------------
    def take_stores(self) -> list[tuple[int, bytes]]:
        evicted, self.pool.evicted = self.pool.evicted, []
        return [(b, k) for b, k in evicted if not self.store.contains(k)]

    def take_loads(self) -> list[tuple[int, bytes]]:
        loads, self._loads = self._loads, []
        return loads

    def finish_loads(self) -> list[Request]:
        """Applies the loads the runner finished; returns the requests ready to run again."""
        applied, self.store.applied[:] = list(self.store.applied), []
        ready = []
        for block_id, ok in applied:
            rid = self._by_block.pop(block_id, None)
            if rid is None:
                continue
            entry = self.loading[rid]
            block, key, _ = entry.loads[block_id]
            entry.loads[block_id] = (block, key, ok)
            entry.num_done += 1
            if entry.num_done == len(entry.loads):
                self._release(entry)
                del self.loading[rid]
                if not entry.aborted:
                    ready.append(entry.request)
        return ready

    def _release(self, entry: _Loading) -> None:
        cached = self.pool.cached_block_hash_to_block
        events = self.pool.kv_events
        mark = len(events) if events is not None else 0
        num_ok = 0
        for block, key, ok in entry.loads.values():
            if ok and key not in cached:
                self.pool.cache_block(block, key)
                self.load_log.append((block.block_id, self.pool.hash_tags[block.block_id]))
            if ok and len(key) == 32:
                num_ok += 1  # group 0's keys are the bare 32-byte hash: one per block
            self.num_failed_loads_total += not ok
        if events is not None and len(events) > mark:  # KV events: as a store of these blocks
            req = entry.request
            hashes = self.manager._block_hashes(req)
            if entry.aborted:  # finished: its hashes were dropped, keep it so
                self.manager.req_to_block_hashes.pop(req.request_id, None)
            size = self.manager.block_size
            describe_stored(events, mark, hashes, req.all_token_ids, size,
                            stored_info(req, self.manager.block_hasher, size))
        if not entry.aborted:
            self.hit_tokens_total += num_ok * self.manager.block_size
        self.pool.free_blocks(reversed(entry.pinned))  # the tail of the prefix goes first

    # ---- lookup ------------------------------------------------------------------------------
    def start_load(self, request: Request, num_hit_tokens: int) -> bool:
        """Whether request left the queue to wait for tier blocks past its pool hit."""
        rid = request.request_id
        if (
            not self.manager.enable_caching
            or request.sampling_params.prompt_logprobs is not None
            or self._num_loads.get(rid, 0) >= _MAX_LOADS_PER_REQUEST
        ):
            return False
        bs = self.manager.block_size
        hashes = self.manager._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // bs
        first = num_hit_tokens // bs
        get = self.pool.get_cached_block
        pinned: list[KVCacheBlock] = []
        wanted: list[bytes] = []
        for i in range(max_blocks):
            keys = [g.key(hashes[i]) for g in self.manager.groups]
            in_pool = [get(k) for k in keys]
            pinned += [b for b in in_pool if b is not None]
            if i < first:  # the pool's hit (a sliding group may lack blocks before its window)
                continue
            missing = [k for b, k in zip(in_pool, keys) if b is None]
            if not all(self.store.contains(k) for k in missing):
                pinned = pinned[: len(pinned) - sum(b is not None for b in in_pool)]
                break
            wanted += missing
        self.queries_total += max(0, max_blocks - first) * bs if wanted else 0
        num_pinned_free = sum(1 for b in pinned if b.ref_cnt == 0)
        if not wanted or len(wanted) > self.pool.get_num_free_blocks() - num_pinned_free:
            return False
        self.pool.touch(pinned)
        fresh = self.pool.get_new_blocks(len(wanted))
        entry = _Loading(request, pinned + fresh)
        for block, key in zip(fresh, wanted):
            entry.loads[block.block_id] = (block, key, False)
            self._by_block[block.block_id] = rid
            self._loads.append((block.block_id, key))
        self.loading[rid] = entry
        self._num_loads[rid] = self._num_loads.get(rid, 0) + 1
        return True

    def drop(self, request: Request) -> bool:
        """An abort of a request waiting for loads: its blocks go once the loads land."""
        entry = self.loading.get(request.request_id)
        if entry is None:
            return False
        entry.aborted = True
        self._num_loads.pop(request.request_id, None)
        return True

    def forget(self, request_id: str) -> None:
        self._num_loads.pop(request_id, None)

    def held_blocks(self) -> list[KVCacheBlock]:
        """Blocks the tier holds (pinned or loading), for KVCacheManager.check_integrity."""
        held = [b for entry in self.loading.values() for b in entry.pinned]
        return held + self.swap.held_blocks() if self.swap is not None else held

    def cached_blocks(self) -> list[tuple[int, bytes]]:
        """Every hashed block in the pool (for a flush to the tier at shutdown)."""
        return [
            (b.block_id, k)
            for k, b in self.pool.cached_block_hash_to_block.items()
            if not self.store.contains(k)
        ]
