"""The runner's side of the KV tier: block bytes out of and into the KV tensors.

Called once per step, at the top of ModelRunner.execute, before any copy or forward pass
writes KV: (1) blocks the scheduler evicted this step are snapshotted (a memory copy; the copy
thread writes the file), (2) this step's loads are queued on the copy thread, (3) loads the copy
thread finished are copied into their blocks and reported in store.applied, which the
scheduler reads at its next step. Only (1) and (3) touch the tensors, both on the loop thread,
so no KV tensor is written concurrently with a forward pass.
"""

from __future__ import annotations

import torch

from engine.kv_offload.disk_store import DiskKVStore

_IDLE_WAIT_S = 0.01  # an empty step with loads in flight waits this long for one


class KVOffloadHook:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], store: DiskKVStore):
        seen: dict[int, torch.Tensor] = {}
        for pair in kv_caches:
            for cache in pair:
                seen.setdefault(id(cache), cache)
        self.tensors = list(seen.values())  # layers of several groups share a slot's tensors
        self.store = store
        self.block_bytes = sum(t[0].numel() * t.element_size() for t in self.tensors)
        self.num_inflight = 0

    def step(self, out) -> None:
        if out.kv_stores:
            self.store_blocks(out.kv_stores)
        for block_id, key in out.kv_loads:
            self.store.submit_load(block_id, key)
            self.num_inflight += 1
        if self.num_inflight and out.is_empty:  # nothing else to do: let the disk catch up
            self.store.wait_for_load(_IDLE_WAIT_S)
        for block_id, payload in self.store.poll_loads():
            self.num_inflight -= 1
            ok = payload is not None and len(payload) == self.block_bytes
            if ok:
                self._write_block(block_id, payload)
            self.store.applied.append((block_id, ok))

    def store_blocks(self, blocks: list[tuple[int, bytes]]) -> None:
        """Snapshot each (block id, key) now; the copy thread writes the files."""
        for block_id, key in blocks:
            parts = [t[block_id].contiguous().view(torch.uint8).cpu().numpy() for t in self.tensors]
            self.store.put(key, b"".join(p.tobytes() for p in parts))

    def _write_block(self, block_id: int, payload: bytes) -> None:
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for t in self.tensors:
            row = t[block_id]
            n = row.numel() * row.element_size()
            src = flat[offset : offset + n].view(t.dtype).view(row.shape)
            row.copy_(src.to(t.device))
            offset += n
