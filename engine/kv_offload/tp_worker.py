"""The KV tier on a tensor-parallel worker (engine/executor/worker.py): each rank stores and
loads its own shard of every block, in its own folder, and reports to the engine what changed.

Every rank runs the same hook as the uni executor (runner_hook.py) against its own KV tensors
and its own DiskKVStore: <dir>/tp<N>-rank<r>/<fingerprint>/, the fingerprint covering the TP
size and the rank, so a restart with another TP size never reuses a file. After each step every
rank's news (loads applied to its tensors, keys whose files appeared in or left its index, its
byte counters) is gathered to rank 0 (one gloo gather on the CPU group: no disk wait), which
hands the list to the engine in ModelRunnerOutput.kv_tier_reports; the engine's RankedTierIndex
(tp_index.py) counts a block stored or loaded only once every rank has it.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from engine.kv_offload.disk_store import DiskKVStore
from engine.kv_offload.runner_hook import KVOffloadHook


class JournaledIndex(OrderedDict):
    """A DiskKVStore's index that records each key entering or leaving it, in order (every
    change happens under the store's lock, where the journal is also drained)."""

    def __init__(self, items, journal: list) -> None:
        super().__init__()
        self.journal = journal
        for key, size in items:
            self[key] = size

    def __setitem__(self, key, value) -> None:
        if key not in self:
            self.journal.append((key, True))
        super().__setitem__(key, value)

    def pop(self, key, *default):
        had = key in self
        value = super().pop(key, *default)
        if had:
            self.journal.append((key, False))
        return value

    def popitem(self, last: bool = True):
        key, value = super().popitem(last)
        self.journal.append((key, False))
        return key, value


def rank_dir(base: Path, world_size: int, rank: int) -> Path:
    return Path(base) / f"tp{world_size}-rank{rank}"


class WorkerTier:
    """One rank's store and hook, and its per-step report."""

    def __init__(self, store: DiskKVStore, hook: KVOffloadHook, tp) -> None:
        self.store, self.hook, self.tp = store, hook, tp
        self.journal: list[tuple[bytes, bool]] = []
        with store._lock:  # the files a previous run left are the first news
            store._index = JournaledIndex(store._index.items(), self.journal)

    def _own_report(self) -> dict:
        store = self.store
        with store._lock:
            changes, self.journal[:] = list(self.journal), []
        applied, store.applied[:] = list(store.applied), []
        return dict(
            rank=self.tp.rank, applied=applied, changes=changes,
            stored=store.bytes_stored_total, loaded=store.bytes_loaded_total,
            usage=store.usage_bytes, capacity=store.capacity_bytes,
            corrupt=store.num_corrupt_total,
        )  # fmt: skip

    def report(self) -> list[dict] | None:
        """Every rank's report on rank 0 (None elsewhere); a collective: all ranks call it."""
        own = self._own_report()
        if self.tp.world_size == 1:
            return [own]
        import torch.distributed as dist

        gathered = [None] * self.tp.world_size if self.tp.is_driver else None
        dist.gather_object(own, gathered, dst=0, group=self.tp.cpu_group)
        return gathered

    def close(self) -> None:
        """Finish the queued writes (the engine's shutdown flush), stop the copy thread."""
        self.store.close()


def attach_worker_tier(cfg, model_dir, runner) -> WorkerTier | None:
    """This rank's tier when the config asks for one; --kv-offloading-size is the total over
    the ranks (vLLM's meaning), so each rank holds its share."""
    if cfg.kv_offloading_size is None:
        return None
    from engine.kv_offload.setup import default_dir, runner_fingerprint

    tp = runner.tp
    base = Path(cfg.kv_offloading_dir) if cfg.kv_offloading_dir else default_dir()
    capacity = int(cfg.kv_offloading_size * 2**30) // tp.world_size
    fp = runner_fingerprint(cfg, model_dir, runner)
    store = DiskKVStore(rank_dir(base, tp.world_size, tp.rank), capacity, fp)
    hook = KVOffloadHook(runner.kv_caches, store)
    runner.kv_offload = hook
    return WorkerTier(store, hook, tp)
