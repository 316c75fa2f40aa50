"""The second KV tier in host memory (RAM): evicted prefix-cache blocks kept as host copies,
LRU within --kv-offloading-size, gone at exit (no persistence). It is the store and the runner's
hook in one (engine/kv_offload/runner_hook.py is the disk tier's hook): the same step(out) /
store_blocks() on the runner side and contains() / applied / counters on the scheduler side
(engine/core/kv_tier.py), so the scheduler cannot tell the two tiers apart.

Each stored block is one uint8 host buffer holding the block's rows of every KV tensor, in
tensor order; buffers are reused (the least recently used block's goes first once the bound is
reached) and never handed out while a load still reads them.

How the copies leave the step loop:
- On a GPU (vLLM's CPU offloading, llama.cpp's --cache-ram): buffers are pinned, and both ways
  are non_blocking copies on a side stream. A step's copies wait for the compute stream's work
  so far, and the compute stream waits for them (on the GPU, not the host) before this step's
  forward can overwrite an evicted block. Completion is a CUDA event, polled each step.
- On CPU: a store is one memcpy that must land before this step's forward may overwrite the
  evicted block (the disk tier's snapshot is the same copy), so it runs on the loop; a load
  writes a block only the tier holds (no request reads it until applied), so the copy thread
  does it while the loop goes on.
Either way a loaded block is reported in `applied` only once its copy is complete.

Swap preemption (engine/core/kv_swap.py) puts a victim's blocks under SWAP_PREFIX keys: they are
pinned (never LRU victims, never prefix hits: contains() is False), read once, then their
buffers are free again; prefix blocks make way for them within the bound (swap_room).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque

import torch

from engine.core.kv_swap import SWAP_PREFIX

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.01  # an empty step with loads in flight waits this long for one


class HostKVStore:
    """Keys (prefix-cache block keys) -> host copies of blocks, with the runner's hook."""

    directory = None  # nothing on disk
    persistent = False  # shutdown does not flush the pool into it
    num_corrupt_total = 0  # no files, no checksums

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], capacity_bytes: int):
        seen: dict[int, torch.Tensor] = {}
        for pair in kv_caches:
            for cache in pair:
                seen.setdefault(id(cache), cache)
        self.tensors = list(seen.values())  # layers of several groups share a slot's tensors
        self.sizes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.sizes)
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_bytes // self.block_bytes
        self.cuda = self.tensors[0].is_cuda
        self.stream = torch.cuda.Stream(self.tensors[0].device) if self.cuda else None
        self._index: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # complete copies, LRU first
        self._stores: dict[bytes, tuple[torch.Tensor, object]] = {}  # in flight (CUDA)
        self._swap: dict[bytes, torch.Tensor] = {}  # swapped-out blocks, pinned until loaded
        self._free: list[torch.Tensor] = []  # buffers of swap entries loaded or dropped
        self._num_buffers = 0
        self._reading: dict[bytes, int] = {}  # key -> loads in flight reading its buffer
        self._loads: list[tuple] = []  # in flight: block id, key, event, buffer
        self._lock = threading.Condition()
        self._jobs: deque[tuple[int, bytes, torch.Tensor]] = deque()  # CPU loads, copy thread
        self._done: deque[tuple[int, bool]] = deque()  # loads the copy thread finished
        self._stop = False
        self.num_inflight = 0
        self.bytes_stored_total = self.bytes_loaded_total = 0
        self.num_dropped_total = 0  # stores skipped: every buffer busy
        self.applied: list[tuple[int, bool]] = []  # read by KVTier.finish_loads
        self._thread = None
        if not self.cuda:
            self._thread = threading.Thread(target=self._run, name="kv-tier-ram", daemon=True)
            self._thread.start()

    # ---- the scheduler's side ----------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        """Whether key's copy is complete (only such keys are tier hits)."""
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def usage_bytes(self) -> int:
        return len(self._index) * self.block_bytes

    @property
    def swap_bytes(self) -> int:
        return len(self._swap) * self.block_bytes

    def swap_room(self, num_bytes: int) -> bool:
        """Whether num_bytes more of swap fit the bound (prefix blocks make way for it)."""
        return self.swap_bytes + num_bytes <= self.capacity_blocks * self.block_bytes

    def drop_swap(self, key: bytes) -> None:
        """Forget a swap entry that will not be loaded (its blocks were still in the pool)."""
        buf = self._swap.pop(key, None)
        if buf is not None:
            self._free.append(buf)

    # ---- the runner's side (the loop thread) -------------------------------------------------
    def step(self, out) -> None:
        """At the top of ModelRunner.execute: this step's stores and loads, then finished loads."""
        if self.cuda and (out.kv_stores or out.kv_loads):
            self.stream.wait_stream(torch.cuda.current_stream())
        # The loads' buffers are held first, so this step's stores never reuse one of them; the
        # stores go first, as a load may land in a block evicted (and stored) this step.
        loads = [(block_id, key, self._hold(key)) for block_id, key in out.kv_loads]
        self.store_blocks(out.kv_stores)
        for block_id, key, buf in loads:
            self._load(block_id, key, buf)
        if self.num_inflight and out.is_empty:  # nothing else to do: let the copies catch up
            self.wait_for_load(_IDLE_WAIT_S)
        self._poll()

    def store_blocks(self, blocks: list[tuple[int, bytes]]) -> None:
        for block_id, key in blocks:
            if key in self._index:
                self._index.move_to_end(key)
            elif key not in self._stores and key not in self._swap:
                self._store(block_id, key)
        if self.cuda and blocks:  # the forward may overwrite an evicted block: after the copy
            torch.cuda.current_stream().wait_stream(self.stream)

    def _store(self, block_id: int, key: bytes) -> None:
        buf = self._take_buffer()
        if buf is None:
            self.num_dropped_total += 1
            return
        if key.startswith(SWAP_PREFIX):  # loaded later on the same stream / after this copy
            self._copy_out(block_id, buf)
            self._swap[key] = buf
            self.bytes_stored_total += self.block_bytes
        elif self.cuda:
            with torch.cuda.stream(self.stream):
                self._copy_out(block_id, buf)
                event = torch.cuda.Event()
                event.record()
            self._stores[key] = (buf, event)
        else:
            self._copy_out(block_id, buf)
            self._add(key, buf)

    def _hold(self, key: bytes) -> torch.Tensor | None:
        """key's buffer, kept from reuse until its load is done (None: not in the store)."""
        if key.startswith(SWAP_PREFIX):  # read once: the buffer is free when the load is done
            return self._swap.pop(key, None)
        buf = self._index.get(key)
        if buf is not None:
            self._index.move_to_end(key)
            self._reading[key] = self._reading.get(key, 0) + 1
        return buf

    def _load(self, block_id: int, key: bytes, buf: torch.Tensor | None) -> None:
        if buf is None:  # not in the store (the scheduler saw it there: cannot happen)
            self.applied.append((block_id, False))
            return
        self.num_inflight += 1
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.copy_in(block_id, buf)
                event = torch.cuda.Event()
                event.record()
            self._loads.append((block_id, key, event, buf))
            return
        self._loads.append((block_id, key, None, buf))
        with self._lock:
            self._jobs.append((block_id, key, buf))
            self._lock.notify_all()

    def _poll(self) -> None:
        """Stores whose copies completed join the index; finished loads go to applied."""
        for key, (buf, event) in list(self._stores.items()):
            if event.query():
                del self._stores[key]
                self._add(key, buf)
        with self._lock:
            done, self._done = dict(self._done), deque()
        still = []
        for block_id, key, event, buf in self._loads:
            if event.query() if event is not None else block_id in done:
                ok = done.get(block_id, True)
                self.num_inflight -= 1
                self._release(key, buf)
                self.bytes_loaded_total += self.block_bytes * ok
                self.applied.append((block_id, ok))
            else:
                still.append((block_id, key, event, buf))
        self._loads = still

    def wait_for_load(self, timeout: float) -> None:
        """Block up to timeout until a load is done (only when the loop has nothing else)."""
        if self.cuda:
            if self._loads:
                self._loads[0][2].synchronize()  # a host-to-device copy: microseconds
            return
        with self._lock:
            if not self._done:
                self._lock.wait_for(lambda: bool(self._done) or self._stop, timeout)

    # ---- buffers -----------------------------------------------------------------------------
    def _release(self, key: bytes, buf: torch.Tensor) -> None:
        """A load of key is done: a swap buffer is free, a prefix block's may be reused."""
        if key.startswith(SWAP_PREFIX):
            self._free.append(buf)
            return
        self._reading[key] -= 1
        if not self._reading[key]:
            del self._reading[key]

    def _add(self, key: bytes, buf: torch.Tensor) -> None:
        self._index[key] = buf
        self.bytes_stored_total += self.block_bytes

    def _take_buffer(self) -> torch.Tensor | None:
        """A free or new buffer within the bound, or the least recently used block's."""
        if self._free:
            return self._free.pop()
        if self._num_buffers < self.capacity_blocks:
            self._num_buffers += 1
            return torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self.cuda)
        for key in self._index:  # oldest first; one a load still reads stays
            if key not in self._reading:
                return self._index.pop(key)
        return None

    def _rows(self, buf: torch.Tensor, block_id: int):
        """(the block's row of each KV tensor, the matching view of buf)."""
        offset = 0
        for t, n in zip(self.tensors, self.sizes):
            row = t[block_id]
            yield row, buf[offset : offset + n].view(t.dtype).view(row.shape)
            offset += n

    def _copy_out(self, block_id: int, buf: torch.Tensor) -> None:
        rows, hosts = zip(*self._rows(buf, block_id))
        torch._foreach_copy_(list(hosts), list(rows), non_blocking=self.cuda)

    def copy_in(self, block_id: int, buf: torch.Tensor) -> None:
        """The one copy into the KV cache (a test overrides it to hold a load back). One call
        for every tensor: the copy thread gives the GIL up once per block, not once per tensor
        (a thread waits up to the 5 ms switch interval to get it back, each time)."""
        rows, hosts = zip(*self._rows(buf, block_id))
        torch._foreach_copy_(list(rows), list(hosts), non_blocking=self.cuda)

    # ---- the copy thread (CPU) ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._stop or self._jobs)
                if not self._jobs:
                    return
                block_id, _, buf = self._jobs.popleft()
            try:
                self.copy_in(block_id, buf)
                ok = True
            except Exception:  # noqa: BLE001 - a failed copy loses one block, never the thread
                logger.exception("KV tier: copy into block %d failed", block_id)
                ok = False
            with self._lock:
                self._done.append((block_id, ok))
                self._lock.notify_all()

    def close(self) -> None:
        """Finish the loads in flight, then stop the copy thread (the blocks are dropped)."""
        if self.cuda:
            self.stream.synchronize()
        elif self._thread is not None:
            with self._lock:
                self._stop = True
                self._lock.notify_all()
            self._thread.join()
        self._index.clear()
        self._swap.clear()
        self._free.clear()
