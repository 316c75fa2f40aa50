"""What the KV map marks beyond ref counts (no torch): blocks made by a copy-on-write, blocks
loaded back from the second KV tier, and the fork/tier state of requests.

The manager and the tier append to bounded logs as they go (`KVCacheManager.cow_log`:
(block id, request id, group, table index) per copy; `KVTier.load_log`: (block id, hash tag) per
loaded block; deques at most MAX_MARKED_BLOCKS long); a capture (engine/core/kv_view.py) keeps
the entries still true, at O(MAX_MARKED_BLOCKS), and drops the others for good:

- a copy-on-write block stays marked while the request it was copied for still holds it at
  that place of its table (so a freed and reused block loses the mark);
- a tier block stays marked while it holds the prefix-cache hash it was loaded under (its hash
  tag unchanged; an eviction clears or changes it).

Swapped-out requests (engine/core/kv_swap.py) hold no blocks in the pool: the map lists them
(at most MAX_SWAPPED_LISTED) with their state and the number of blocks in the tier.
"""

from __future__ import annotations

import itertools
from collections import deque

MAX_MARKED_BLOCKS = 256
MAX_SWAPPED_LISTED = 64


def new_log() -> deque:
    return deque(maxlen=MAX_MARKED_BLOCKS)


def live_cow_blocks(groups, log: deque) -> tuple[int, ...]:
    """Copy-on-write blocks still held where they were copied to, oldest first."""
    if not log:
        return ()
    keep = []
    for entry in log:
        block_id, rid, group, i = entry
        ids = groups[group].req_to_block_ids.get(rid, ())
        if i < len(ids) and ids[i] == block_id:
            keep.append(entry)
    if len(keep) != len(log):
        log.clear()
        log.extend(keep)
    return tuple(e[0] for e in keep)


def live_tier_blocks(pool, log: deque) -> tuple[int, ...]:
    """Blocks loaded from the tier that still hold the hash they were loaded under."""
    if not log:
        return ()
    tags = pool.hash_tags
    keep = [(b, t) for b, t in log if tags[b] == t]
    if len(keep) != len(log):
        log.clear()
        log.extend(keep)
    return tuple(b for b, _ in keep)


def swap_marks(swap) -> dict:
    """The KV snapshot's swap fields: the requests swapped out (or loading back) and counters."""
    if swap is None:
        return {}
    listed = itertools.islice(swap.entries.items(), MAX_SWAPPED_LISTED)
    return {
        "swapped_out": tuple((rid, e.state, len(e.keys)) for rid, e in listed),
        "kv_swap_totals": (swap.num_swapped_out_total, swap.out_blocks_total, swap.in_blocks_total),
    }
