"""The engine's side of a KV tier split over tensor-parallel ranks (no torch).

The scheduler's KVTier (engine/core/kv_tier.py) asks its store two things: contains(key) and
applied (the loads finished since its last step). Under the mp executor the files live in the
workers (tp_worker.py); this index stands in for the store, fed by the reports every step's
ModelRunnerOutput carries (and the workers' ready messages, for the files found at start):

- a key is in the tier only while every rank's index holds its file (a rank that evicted it,
  or found it corrupt, makes it a miss: the block is recomputed, never half loaded);
- a load is applied only once every rank has copied its shard into the block, and is ok only
  if every rank's was.

The step loop never waits for a rank: an unfinished load simply keeps its request waiting.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine.core.kv_swap import KVSwap
from engine.core.kv_tier import KVTier
from engine.kv_offload.setup import KVOffload

logger = logging.getLogger(__name__)


class RankedTierIndex:
    def __init__(self, world_size: int, directory: Path) -> None:
        self.world_size = world_size
        self.directory = directory
        self._counts: dict[bytes, int] = {}  # key -> ranks whose index holds its file
        self._num_present = 0
        self._loads: dict[int, list] = {}  # block id -> [ranks reported, all ok]
        self._totals: dict[int, dict] = {}  # rank -> its latest counters
        self.applied: list[tuple[int, bool]] = []  # drained by KVTier.finish_loads

    def contains(self, key: bytes) -> bool:
        return self._counts.get(key, 0) == self.world_size

    def __len__(self) -> int:
        return self._num_present

    def absorb(self, reports: list[dict]) -> None:
        for report in reports:
            self._totals[report["rank"]] = report
            for key, present in report["changes"]:
                self._count(key, 1 if present else -1)
            for block_id, ok in report["applied"]:
                state = self._loads.setdefault(block_id, [0, True])
                state[0] += 1
                state[1] = state[1] and ok
                if state[0] == self.world_size:
                    del self._loads[block_id]
                    self.applied.append((block_id, state[1]))

    def _count(self, key: bytes, delta: int) -> None:
        before = self._counts.get(key, 0)
        after = before + delta
        if after > 0:
            self._counts[key] = after
        else:
            self._counts.pop(key, None)
        full = self.world_size
        self._num_present += (after == full) - (before == full)

    def _sum(self, name: str) -> int:
        return sum(r[name] for r in self._totals.values())

    bytes_stored_total = property(lambda self: self._sum("stored"))
    bytes_loaded_total = property(lambda self: self._sum("loaded"))
    usage_bytes = property(lambda self: self._sum("usage"))
    capacity_bytes = property(lambda self: self._sum("capacity"))
    num_corrupt_total = property(lambda self: self._sum("corrupt"))


class RankedKVOffload(KVOffload):
    """The tier of an engine on worker processes: no hook here, the ranks hold the files."""

    def __init__(self, engine, index: RankedTierIndex, tier: KVTier) -> None:
        super().__init__(index, None, tier)
        self.engine = engine

    def shutdown(self) -> None:
        """One last step that only stores every block still cached in the pool; the workers
        finish their writes when the executor stops them."""
        from engine.core.scheduler_output import SchedulerOutput
        from engine.executor.executor import EngineDeadError

        executor = self.engine.executor
        if executor.dead is not None:
            return
        try:
            executor.execute(SchedulerOutput(kv_stores=self.tier.cached_blocks()))
        except EngineDeadError:
            logger.warning("KV tier: the workers are gone; the pool's blocks were not flushed")


def attach_ranked_kv_offload(engine, directory: Path) -> RankedKVOffload:
    """The scheduler's tier over the workers' stores (setup.attach_kv_offload's mp branch)."""
    executor = engine.executor
    world = engine.config.tensor_parallel_size
    index = RankedTierIndex(world, directory)
    reports = executor.workers.infos[0].get("kv_tier")
    if reports is None:
        raise ValueError("--kv-offloading-size: the workers built no KV tier")
    index.absorb(reports)
    executor.on_kv_tier_reports = index.absorb
    manager = engine.scheduler.kv_cache_manager
    tier = KVTier(manager, index)
    manager.tier = tier
    engine.scheduler.kv_tier = tier
    # swap preemption under TP: not yet, every preemption recomputes (min_tokens None: never)
    tier.swap = engine.scheduler.kv_swap = KVSwap(manager, index, 0, min_tokens=None)
    logger.info(
        "KV tier: %.2f GiB on disk over %d ranks in %s/tp%d-rank*/ (%d blocks found)",
        engine.config.kv_offloading_size, world, directory, world, len(index),
    )  # fmt: skip
    return RankedKVOffload(engine, index, tier)
