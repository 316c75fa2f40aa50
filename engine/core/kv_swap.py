"""Swap preemption (no torch): a victim's computed KV blocks go to the second KV tier and come
back on resume, instead of being recomputed.

- Out (Scheduler._preempt): if the rule below says swap, every block holding the victim's
  computed tokens (the partly filled last one included) is snapshotted by the runner's tier hook
  at the top of this step, before anything writes KV (SchedulerOutput.kv_stores, under SWAP_PREFIX
  keys, which the store pins: never evicted, read once, then deleted). The victim's blocks are
  then freed as in a recompute preemption and it waits at the front of the queue.
- In (Scheduler._schedule_waiting): at the head of the queue, full blocks still cached in the
  pool are taken from it (their swap copies are dropped); fresh blocks are taken for the others
  and their loads go out in SchedulerOutput.kv_loads. The request leaves the queue while the copy
  thread reads (the loop never waits on disk; a load whose write is still queued is served from
  memory). Once every load is applied it returns to the front, and its admission hands the
  blocks to allocate_slots as hits of num_tokens computed tokens: it resumes where it stopped.
- A failed load (a torn or missing file) keeps the blocks before it; the rest is recomputed.
  Recompute stays the rule when the tier is off, full (the swap would pass --kv-offloading-size),
  or for what swap does not cover yet: several KV-cache groups (sliding windows), images, prompt
  logprobs and pooling requests.

The rule (measured by `bench/kv_tier.py --workload swap-cost`, docs/architecture.md): swap when
the victim has computed at least SWAP_MIN_TOKENS tokens. Recompute pays again the prefill slope
per token; a swap pays per block a snapshot and a copy back on the loop, plus the copy thread's
write and read (counted: on a 2-core host it competes for a core), and once a step of latency
(the resumed request's loads land a step after they are asked for). Measured on the shared
2-core host, SmolLM2-135M, 16-token blocks: 39.5 ms per recomputed token against 10.4 ms per
swapped block (0.65 ms per token, x61 cheaper) and a 283 ms decode step, so swap wins from
T* = 8 tokens; the threshold is that rounded up to one block (below it there is no full block to
save and the timings are noise). Both costs grow with the model (FLOPs vs KV bytes per token),
so the crossover stays near a block for dense models of this shape; a GPU pool must measure anew.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from engine.core.block_pool import KVCacheBlock
from engine.core.kv_cache_groups import cdiv
from engine.core.request import Request

SWAP_PREFIX = b"\x00swap"  # keys the store pins (engine/kv_offload/disk_store.py)
SWAP_MIN_TOKENS = 16  # the rule above; KVSwap.min_tokens overrides it (0: always, None: never)
LOADING = "loading"  # KVSwap.resume: the request left the queue for its loads
WAIT = "wait"  # KVSwap.resume: not enough free blocks yet, the head waits


@dataclass
class _Swapped:
    request: Request
    num_tokens: int  # computed tokens the swapped blocks hold
    keys: list[bytes]  # one per block, table order
    blocks: list[KVCacheBlock] = field(default_factory=list)  # held while loading / ready
    loads: dict[int, int] = field(default_factory=dict)  # block id -> table index
    failed_at: int | None = None  # first table index whose load failed
    num_done: int = 0
    state: str = "out"  # out -> loading -> ready
    aborted: bool = False


class KVSwap:
    def __init__(self, manager, store, block_bytes: int, min_tokens: int | None = SWAP_MIN_TOKENS):
        self.manager = manager
        self.pool = manager.block_pool
        self.store = store  # put / submit_load by key, swap_room, drop_swap, applied
        self.block_bytes = block_bytes
        self.min_tokens = min_tokens
        self.entries: dict[str, _Swapped] = {}  # request id -> its swapped blocks
        self._by_block: dict[int, str] = {}  # block id being loaded -> request id
        self._stores: list[tuple[int, bytes]] = []
        self._loads: list[tuple[int, bytes]] = []
        self._seq = 0
        self.num_swapped_out_total = 0  # preemptions that swapped
        self.num_recomputed_total = 0  # preemptions that recomputed (the rule, or no room)
        self.out_blocks_total = 0  # blocks copied to the tier
        self.in_blocks_total = 0  # blocks loaded back from the tier
        self.pool_blocks_total = 0  # blocks found still cached in the pool on resume
        self.num_failed_loads_total = 0

    # ---- out ---------------------------------------------------------------------------------
    def should_swap(self, req: Request) -> bool:
        """The rule (module docstring), and what swap does not cover."""
        num = req.num_computed_tokens
        return (
            self.min_tokens is not None
            and num >= max(self.min_tokens, 1)
            and not self.manager.is_hybrid
            and not req.mm_inputs
            and req.pooling_params is None
            and req.sampling_params.prompt_logprobs is None
            and self.store.swap_room(cdiv(num, self.manager.block_size) * self.block_bytes)
        )

    def swap_out(self, req: Request) -> bool:
        """Whether req's blocks are copied out (call before its blocks are freed)."""
        if not self.should_swap(req):
            self.num_recomputed_total += 1
            return False
        rid = req.request_id
        num_blocks = cdiv(req.num_computed_tokens, self.manager.block_size)
        ids = self.manager.get_block_ids(rid)[:num_blocks]
        self._seq += 1
        keys = [
            SWAP_PREFIX + hashlib.sha256(f"{rid}\0{self._seq}\0{i}".encode()).digest()
            for i in range(len(ids))
        ]
        self._stores += zip(ids, keys)
        self.entries[rid] = _Swapped(req, req.num_computed_tokens, keys)
        self.num_swapped_out_total += 1
        self.out_blocks_total += len(ids)
        return True

    def take_stores(self) -> list[tuple[int, bytes]]:
        stores, self._stores = self._stores, []
        return stores

    def take_loads(self) -> list[tuple[int, bytes]]:
        loads, self._loads = self._loads, []
        return loads

    # ---- in ----------------------------------------------------------------------------------
    def resume(self, req: Request):
        """At the head of the queue: LOADING (loads went out, req leaves the queue), WAIT (too
        few free blocks), or (hit blocks, computed tokens) for allocate_slots once loaded."""
        entry = self.entries[req.request_id]
        if entry.state == "ready":
            return entry.blocks, entry.num_tokens
        if any(e.state != "out" for e in self.entries.values()):
            return WAIT  # one swap-in at a time: two half-admitted could hold the pool between them
        hashes = self.manager._block_hashes(req)
        get, group = self.pool.get_cached_block, self.manager.groups[0]
        in_pool = [
            get(group.key(hashes[i])) if i < len(hashes) and (i + 1) * self.manager.block_size
            <= entry.num_tokens else None
            for i in range(len(entry.keys))
        ]  # fmt: skip
        num_load = sum(b is None for b in in_pool)
        num_pinned_free = sum(1 for b in in_pool if b is not None and b.ref_cnt == 0)
        bs = self.manager.block_size
        num_next = cdiv(entry.num_tokens + 1, bs) - len(entry.keys)  # its next token's block
        if num_load + num_next > self.pool.get_num_free_blocks() - num_pinned_free:
            return WAIT
        self.pool.touch(b for b in in_pool if b is not None)
        fresh = iter(self.pool.get_new_blocks(num_load))
        for i, (block, key) in enumerate(zip(in_pool, entry.keys)):
            if block is not None:
                self.store.drop_swap(key)
                self.pool_blocks_total += 1
                entry.blocks.append(block)
                continue
            block = next(fresh)
            entry.blocks.append(block)
            entry.loads[block.block_id] = i
            self._by_block[block.block_id] = req.request_id
            self._loads.append((block.block_id, key))
        if not entry.loads:
            entry.state = "ready"
            return entry.blocks, entry.num_tokens
        entry.state = LOADING
        return LOADING

    def finish_loads(self) -> list[Request]:
        """Takes this tier's applied loads out of store.applied (the KV tier's stay there);
        returns the requests whose blocks are all back, for the front of the queue."""
        applied = self.store.applied
        mine = [(b, ok) for b, ok in applied if b in self._by_block]
        if not mine:
            return []
        applied[:] = [(b, ok) for b, ok in applied if b not in self._by_block]
        ready = []
        for block_id, ok in mine:
            entry = self.entries[self._by_block.pop(block_id)]
            entry.num_done += 1
            index = entry.loads[block_id]
            if ok:
                self.in_blocks_total += 1
            else:
                self.num_failed_loads_total += 1
                entry.failed_at = index if entry.failed_at is None else min(index, entry.failed_at)
            if entry.num_done == len(entry.loads) and self._loaded(entry):
                ready.append(entry.request)
        return ready

    def _loaded(self, entry: _Swapped) -> bool:
        """Every load of entry landed: whether its request goes back to the queue."""
        rid = entry.request.request_id
        if entry.aborted:
            self.pool.free_blocks(reversed(entry.blocks))
            del self.entries[rid]
            return False
        if entry.failed_at is not None:  # keep the blocks before it, recompute the rest
            keep = entry.failed_at
            self.pool.free_blocks(reversed(entry.blocks[keep:]))
            entry.blocks = entry.blocks[:keep]
            entry.num_tokens = min(entry.num_tokens, keep * self.manager.block_size)
            if not keep:
                del self.entries[rid]  # an ordinary recompute
                return True
        entry.state = "ready"
        return True

    def resumed(self, req: Request, num_new: int) -> None:
        """req was admitted with its swapped blocks as hits: the swap's references go, and its
        full blocks (loaded ones, and the last one once it fills) are cached as they would be."""
        entry = self.entries.pop(req.request_id)
        self.pool.free_blocks(reversed(entry.blocks))  # the request holds them now
        if self.manager.enable_caching:
            group = self.manager.groups[0]
            group.num_cached_blocks[req.request_id] = 0
            end = min(entry.num_tokens + num_new, req.num_tokens)
            group.cache_blocks(req.request_id, self.manager._block_hashes(req),
                               end // self.manager.block_size)  # fmt: skip

    def keep_ready_first(self, waiting) -> None:
        """The swap-in under way, loaded, goes to the head of the queue (before requests
        preempted or loaded from the tier since): it holds its blocks, so it must run next."""
        for entry in self.entries.values():
            if entry.state == "ready" and entry.request in waiting:
                waiting.appendleft(entry.request)

    # ---- abort -------------------------------------------------------------------------------
    def is_loading(self, req: Request) -> bool:
        entry = self.entries.get(req.request_id)
        return entry is not None and entry.state == LOADING

    def drop(self, req: Request) -> None:
        """A finished (aborted) request: its swap goes; a loading one's blocks once they land."""
        entry = self.entries.get(req.request_id)
        if entry is None:
            return
        if entry.state == LOADING:
            entry.aborted = True
            return
        del self.entries[req.request_id]
        if entry.state == "out":
            for key in entry.keys:
                self.store.drop_swap(key)
        else:
            self.pool.free_blocks(reversed(entry.blocks))

    @property
    def num_loading(self) -> int:
        return len(self._by_block)

    def held_blocks(self) -> list[KVCacheBlock]:
        """Blocks swap-ins hold (loading or loaded), for KVCacheManager.check_integrity."""
        return [b for entry in self.entries.values() for b in entry.blocks]
