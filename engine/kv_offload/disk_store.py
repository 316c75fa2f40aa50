"""The second KV tier on local disk: one file per evicted prefix-cache block (no torch).

A copy thread does every file operation; the engine's step loop only queues work and polls
results, so it never waits on the disk. Files live in <directory>/<fingerprint[:16]>/ and each
one starts with a header that names the fingerprint (model, dtype, block size, tokenizer, KV
layout: engine/kv_offload/setup.py) and the sha256 of its payload, so a file written for another
model, or torn by a crash, is skipped with a log line and never loaded.

    file = MAGIC | fingerprint (32) | key length (u32) | payload length (u64) | sha256 (32)
           | key | payload (the block's bytes in every KV tensor, in tensor order)

The store is bounded in bytes (--kv-offloading-size); the least recently used file goes first.

Swap (engine/core/kv_swap.py): a preempted request's blocks are put under keys starting with
SWAP_PREFIX. They are pinned: never evicted by the LRU, never prefix-cache hits (contains() is
False), read once and then deleted, and files of a previous run are deleted at start (*.swap). A
swap load whose write is still queued is served from memory without touching the disk.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
from collections import OrderedDict, deque
from pathlib import Path

from engine.core.kv_swap import SWAP_PREFIX

logger = logging.getLogger(__name__)

MAGIC = b"PSKVT\x00\x01\x00"
_HEADER = struct.Struct("<8s32sIQ32s")
SUFFIX = ".kv"
SWAP_SUFFIX = ".swap"


class DiskKVStore:
    """Keys (prefix-cache block keys, bytes) -> payloads (bytes) in files, with an LRU index of
    the files completely written. put/submit_load queue work; poll_loads drains results."""

    def __init__(self, directory: str | Path, capacity_bytes: int, fingerprint: bytes) -> None:
        assert len(fingerprint) == 32
        self.fingerprint = fingerprint
        self.directory = Path(directory) / fingerprint.hex()[:16]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Condition()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._stores: deque[tuple[bytes, bytes]] = deque()
        self._pending: set[bytes] = set()  # queued stores
        self._loads: deque[tuple[object, bytes]] = deque()
        self._results: deque[tuple[object, bytes | None]] = deque()
        self._stop = False
        self.usage_bytes = 0
        self.bytes_stored_total = self.bytes_loaded_total = 0
        self.num_corrupt_total = 0
        self._swap_pending: dict[bytes, bytes] = {}  # swap key -> payload not yet on disk
        self._swap_files: dict[bytes, int] = {}  # swap key -> payload length, on disk
        self._swap_dead: set[bytes] = set()  # swap files to delete (dropped before loaded)
        self.swap_bytes = 0  # payload bytes of live swap entries (pending or on disk)
        # The runner hook appends (block id, ok) here once a load's bytes are in the KV cache;
        # the scheduler's KVTier drains it (both on the engine thread).
        self.applied: list[tuple[int, bool]] = []
        self._scan()
        self._thread = threading.Thread(target=self._run, name="kv-tier-copy", daemon=True)
        self._thread.start()

    # ---- the engine thread -------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        """Whether key's file is completely written (only such keys are tier hits)."""
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def put(self, key: bytes, payload: bytes) -> None:
        """Queue a block's bytes for writing (a key already stored or queued is only touched)."""
        with self._lock:
            if key.startswith(SWAP_PREFIX):
                self._swap_pending[key] = payload
                self.swap_bytes += len(payload)
                self._stores.append((key, b""))
                self._lock.notify()
                return
            if key in self._index:
                self._index.move_to_end(key)
                return
            if key in self._pending:
                return
            self._pending.add(key)
            self._stores.append((key, payload))
            self._lock.notify()

    def submit_load(self, tag: object, key: bytes) -> None:
        """Queue a read of key; poll_loads returns (tag, payload or None if missing/corrupt)."""
        with self._lock:
            payload = self._swap_pending.pop(key, None)
            if payload is not None:  # a swap whose write is still queued: from memory
                self.swap_bytes -= len(payload)
                self._results.append((tag, payload))
                self._lock.notify_all()
                return
            self._loads.append((tag, key))
            self._lock.notify()

    def swap_room(self, num_bytes: int) -> bool:
        """Whether num_bytes more of swap fit the bound (prefix-cache files make way for it)."""
        return self.swap_bytes + num_bytes <= self.capacity_bytes

    def drop_swap(self, key: bytes) -> None:
        """Forget a swap entry that will not be loaded (its request was aborted)."""
        with self._lock:
            payload = self._swap_pending.pop(key, None)
            if payload is not None:
                self.swap_bytes -= len(payload)
                return
            size = self._swap_files.pop(key, None)
            if size is not None:
                self.swap_bytes -= size
                self._swap_dead.add(key)
                self._stores.append((key, b""))  # the copy thread deletes the file
                self._lock.notify()

    def poll_loads(self) -> list[tuple[object, bytes | None]]:
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def wait_for_load(self, timeout: float) -> None:
        """Block up to timeout until a load result is there (only when the loop is idle)."""
        with self._lock:
            if not self._results:
                self._lock.wait_for(lambda: bool(self._results) or self._stop, timeout)

    def close(self) -> None:
        """Finish the queued writes (a restart finds them), then stop the copy thread."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join()

    # ---- the copy thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._stop or self._loads or self._stores)
                if self._loads:  # a load holds up a request: it goes before any store
                    job, is_load = self._loads.popleft(), True
                elif self._stores:
                    job, is_load = self._stores.popleft(), False
                else:
                    return  # stopped with nothing left to write
            try:
                if is_load:
                    tag, key = job
                    result = (tag, self._load(key))
                    with self._lock:
                        self._results.append(result)
                        self._lock.notify_all()
                else:
                    self._store(*job)
            except Exception:  # noqa: BLE001 - a disk error loses one block, never the thread
                logger.exception("KV tier: copy failed")
                if is_load:
                    with self._lock:
                        self._results.append((job[0], None))
                        self._lock.notify_all()
                else:
                    with self._lock:
                        self._pending.discard(job[0])

    def _path(self, key: bytes) -> Path:
        suffix = SWAP_SUFFIX if key.startswith(SWAP_PREFIX) else SUFFIX
        return self.directory / (key.hex() + suffix)

    def _store(self, key: bytes, payload: bytes) -> None:
        if key.startswith(SWAP_PREFIX):
            self._store_swap(key)
            return
        header = _HEADER.pack(
            MAGIC, self.fingerprint, len(key), len(payload), hashlib.sha256(payload).digest()
        )
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        self.write_file(tmp, header + key + payload)
        os.replace(tmp, path)  # a reader sees the whole file or none
        size = _HEADER.size + len(key) + len(payload)
        with self._lock:
            self._pending.discard(key)
            self._index[key] = size
            self.usage_bytes += size
            self.bytes_stored_total += len(payload)
        self._evict(keep=1)

    def _evict(self, keep: int) -> None:
        """Delete least recently used prefix files while the tier (with swap) is over its bound."""
        victims = []
        with self._lock:
            over = lambda: self.usage_bytes + self.swap_bytes > self.capacity_bytes  # noqa: E731
            while over() and len(self._index) > keep:
                old, old_size = self._index.popitem(last=False)
                self.usage_bytes -= old_size
                victims.append(old)
        for old in victims:
            self._path(old).unlink(missing_ok=True)

    def _store_swap(self, key: bytes) -> None:
        """Write a swapped-out block's file, unless it was loaded (from memory) or dropped."""
        path = self._path(key)
        with self._lock:
            payload = self._swap_pending.get(key)
            dead = key in self._swap_dead
            self._swap_dead.discard(key)
        if dead:
            path.unlink(missing_ok=True)
        if payload is None:
            return
        header = _HEADER.pack(
            MAGIC, self.fingerprint, len(key), len(payload), hashlib.sha256(payload).digest()
        )
        tmp = path.with_suffix(".tmp")
        self.write_file(tmp, header + key + payload)
        os.replace(tmp, path)
        with self._lock:
            written = self._swap_pending.pop(key, None) is not None
            if written:
                self._swap_files[key] = len(payload)
                self.bytes_stored_total += len(payload)
        if not written:  # loaded from memory or dropped while the file was written
            path.unlink(missing_ok=True)
        self._evict(keep=0)  # prefix-cache files make way for a live request's blocks

    def _load(self, key: bytes) -> bytes | None:
        path = self._path(key)
        try:
            data = self.read_file(path)
        except FileNotFoundError:
            self._forget(key)
            return None
        problem = self._check(data, key)
        if problem is not None:
            logger.warning("KV tier: skipping %s (%s); the block is recomputed", path, problem)
            self.num_corrupt_total += 1
            self._forget(key)
            path.unlink(missing_ok=True)
            return None
        payload = data[_HEADER.size + len(key) :]
        if key.startswith(SWAP_PREFIX):  # read once: its request holds the block again
            path.unlink(missing_ok=True)
            self._forget(key)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self.bytes_loaded_total += len(payload)
        return payload

    def _check(self, data: bytes, key: bytes) -> str | None:
        """Why data is not key's block for this fingerprint, or None if it is."""
        if len(data) < _HEADER.size:
            return "truncated header"
        magic, fingerprint, key_len, payload_len, digest = _HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a pagedserve KV tier file"
        if fingerprint != self.fingerprint:
            return "written for another model, dtype, block size or tokenizer"
        if data[_HEADER.size : _HEADER.size + key_len] != key:
            return "key mismatch"
        payload = data[_HEADER.size + key_len :]
        if len(payload) != payload_len:
            return f"truncated: {len(payload)} of {payload_len} payload bytes"
        if hashlib.sha256(payload).digest() != digest:
            return "checksum mismatch"
        return None

    def _forget(self, key: bytes) -> None:
        with self._lock:
            if key.startswith(SWAP_PREFIX):
                self.swap_bytes -= self._swap_files.pop(key, 0)
                return
            size = self._index.pop(key, None)
            if size is not None:
                self.usage_bytes -= size

    def write_file(self, path: Path, data: bytes) -> None:
        """The one disk write (a test overrides it to play a slow disk)."""
        with open(path, "wb") as f:
            f.write(data)

    def read_file(self, path: Path) -> bytes:
        """The one disk read (a test overrides it to play a slow disk)."""
        with open(path, "rb") as f:
            return f.read()

    def _scan(self) -> None:
        """Index the files a previous run left (oldest first); verified only when loaded."""
        entries = []
        for path in self.directory.iterdir():
            if path.suffix in (".tmp", SWAP_SUFFIX):  # unfinished write; a dead run's swap
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX:
                try:
                    key = bytes.fromhex(path.stem)
                    st = path.stat()
                except (ValueError, OSError):
                    continue
                entries.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size
            self.usage_bytes += size
        while self.usage_bytes > self.capacity_bytes and self._index:  # a smaller bound now
            old, old_size = self._index.popitem(last=False)
            self.usage_bytes -= old_size
            self._path(old).unlink(missing_ok=True)
        if entries:
            logger.info(
                "KV tier: %d blocks (%.1f MiB) found in %s",
                len(entries),
                self.usage_bytes / 2**20,
                self.directory,
            )
