"""The KV view as HTTP: GET /kv/snapshot (JSON) and GET /kv/stream (SSE of changes).

Snapshots come from the engine thread as copies (engine/core/kv_view.py); everything here runs on
the event loop or in a worker thread, never on the engine thread. Block state in the stream
is one byte per physical block, base64-encoded:

    code = min(ref_cnt, 127) | (128 if the block holds a prefix-cache hash else 0)
    free: code == 0 · cached (evictable): code == 128 · held by requests: code & 127 > 0

The first stream event (`snapshot`) carries every block; later ones (`update`) carry either
the blocks whose code changed as flat [block_id, code, ...] pairs or, when many changed, all
of them again, plus the requests, counters and the events since the previous update.

Marks on top of the codes (`block_marks`, every event): `cow` blocks a copy-on-write made (a
fork's request wrote into a shared block), `tier` blocks loaded back from the KV tier, `image`
blocks holding image placeholder tokens; shared blocks are those with ref count > 1. Requests
carry `forked` (shares blocks through a fork: an n > 1 sibling or a beam) and
`num_image_tokens`; `tier_loading` names the requests waiting for tier loads; `swapped_out`
lists the requests a swap preemption moved to the tier (state out, loading or ready, blocks).

KV cache groups: a request has one block table per group (`groups`), `block_table` is group
0's. An entry of -1 is a block that slid out of a sliding group's window and went back to the
pool; ref counts and occupancy count real blocks only. `kv_cache_groups` describes each group.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator

import numpy as np
from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from engine.core.kv_view import KVSnapshot, KVView
from server.openai.errors import APIError

KEEPALIVE_S = 15.0
MAX_EVENT_BLOCK_IDS = 256  # an event lists at most this many block ids
FULL_UPDATE_FRACTION = 8  # more than 1/8 of the blocks changed: send them all again


def group_ref_counts(snap: KVSnapshot) -> np.ndarray:
    """[num_groups, num_blocks]: how many running requests' tables of each group hold a block
    (placeholders of blocks behind a window excluded)."""
    out = np.zeros((len(snap.group_windows), snap.num_blocks), dtype=np.int32)
    for g in range(len(snap.group_windows)):
        tables = [np.asarray(r.tables[g], dtype=np.int64) for r in snap.requests]
        ids = np.concatenate(tables) if tables else np.zeros(0, dtype=np.int64)
        ids = ids[ids >= 0]
        if len(ids):
            out[g] = np.bincount(ids, minlength=snap.num_blocks)
    return out


def ref_counts(snap: KVSnapshot, per_group: np.ndarray | None = None) -> np.ndarray:
    """Each block's ref count: how many running (request, group) tables hold it."""
    per_group = group_ref_counts(snap) if per_group is None else per_group
    return per_group.sum(axis=0, dtype=np.int32)


def block_codes(snap: KVSnapshot, ref: np.ndarray | None = None) -> np.ndarray:
    ref = ref_counts(snap) if ref is None else ref
    hashed = (np.frombuffer(snap.hash_tags, dtype=np.uint8) != 0).astype(np.uint8)
    return np.minimum(ref, 127).astype(np.uint8) | (hashed << 7)


def hash_groups(snap: KVSnapshot) -> np.ndarray:
    """Per block: the group whose prefix-cache entry it holds, -1 without one."""
    hashed = np.frombuffer(snap.hash_tags, dtype=np.uint8) != 0
    groups = np.zeros(snap.num_blocks, dtype=np.int16)
    if snap.hash_groups:
        groups[:] = np.frombuffer(snap.hash_groups, dtype=np.uint8)
    groups[~hashed] = -1
    return groups


def num_skipped(table) -> int:
    """Leading entries of a table that slid out of the window (they are a leading run)."""
    return int(np.count_nonzero(np.asarray(table) < 0))


def counters(snap: KVSnapshot, ref: np.ndarray) -> dict:
    num_held = snap.num_blocks - snap.num_free_blocks
    queries, hits = snap.prefix_cache_queries_total, snap.prefix_cache_hits_total
    return {
        "num_blocks": snap.num_blocks,
        "num_free_blocks": snap.num_free_blocks - snap.num_cached_free_blocks,
        "num_cached_blocks": snap.num_cached_free_blocks,
        "num_used_blocks": num_held,
        "num_shared_blocks": int(np.count_nonzero(ref > 1)),
        "kv_cache_usage": num_held / snap.num_blocks,
        "num_running": len(snap.requests),
        "num_waiting": snap.num_waiting,
        "num_preemptions_total": snap.num_preemptions_total,
        "num_evictions_total": snap.num_evictions_total,
        "num_window_freed_blocks_total": sum(snap.num_window_freed_blocks_total),
        "prefix_cache_queries_total": queries,
        "prefix_cache_hits_total": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "num_forks_total": snap.num_forks_total,
        "num_cow_copies_total": snap.num_cow_copies_total,
        "kv_tier_hit_tokens_total": snap.kv_tier_hit_tokens_total,
        "kv_tier_queries_total": snap.kv_tier_queries_total,  # -1: no KV tier
        # swap preemption: requests swapped out now, preemptions that swapped, blocks each way
        "num_swapped_out": len(snap.swapped_out),
        "kv_swap_preemptions_total": snap.kv_swap_totals[0],
        "kv_swap_out_blocks_total": snap.kv_swap_totals[1],
        "kv_swap_in_blocks_total": snap.kv_swap_totals[2],
    }


def image_blocks(snap: KVSnapshot) -> list[int]:
    """Held blocks (every group) holding an image's placeholder tokens, ascending."""
    bs, out = snap.block_size, set()
    for r in snap.requests:
        for start, length, *_ in r.mm_spans:
            first, last = start // bs, (start + length - 1) // bs
            for table in r.tables:
                out.update(b for b in table[first : last + 1] if b >= 0)
    return sorted(out)


def block_marks(snap: KVSnapshot) -> dict:
    """Block ids the map marks on top of their state (ref counts say which are shared)."""
    return {
        "cow": sorted(snap.cow_blocks),  # made by a copy-on-write, still held where copied to
        "tier": sorted(snap.tier_blocks),  # loaded back from the KV tier, same content since
        "image": image_blocks(snap),  # holding image placeholder tokens
    }


def kv_cache_groups(snap: KVSnapshot, per_group: np.ndarray, ref: np.ndarray) -> list[dict]:
    """Each group: its kind and window, the blocks it holds, its prefix-cache entries."""
    num_groups = len(snap.group_windows)
    hgroups = hash_groups(snap)
    hashed = hgroups >= 0
    num_hashed = np.bincount(hgroups[hashed], minlength=num_groups)
    num_cached = np.bincount(hgroups[hashed & (ref == 0)], minlength=num_groups)
    freed = snap.num_window_freed_blocks_total or (0,) * num_groups
    return [
        {
            "group": g,
            "kind": "sliding" if window else "full",
            "window": window,
            "num_held_blocks": int(np.count_nonzero(per_group[g])),
            "num_skipped_blocks": sum(num_skipped(r.tables[g]) for r in snap.requests),
            "num_hashed_blocks": int(num_hashed[g]),
            "num_cached_blocks": int(num_cached[g]),
            "num_window_freed_blocks_total": freed[g],
        }
        for g, window in enumerate(snap.group_windows)
    ]


def _requests(snap: KVSnapshot, group: int | None = None) -> list[dict]:
    shown = range(len(snap.group_windows)) if group is None else (group,)
    out = []
    for r in snap.requests:
        tables = r.tables
        groups = []
        for g in shown:
            table = np.asarray(tables[g])
            groups.append(
                {
                    "group": g,
                    "block_table": table.tolist(),
                    "num_skipped_blocks": int(np.count_nonzero(table < 0)),
                }
            )
        out.append(
            {
                "request_id": r.request_id,
                "block_table": np.asarray(r.block_table).tolist(),
                "num_computed_tokens": r.num_computed_tokens,
                "num_tokens": r.num_tokens,
                "num_prompt_tokens": r.num_prompt_tokens,
                "num_cached_tokens": r.num_cached_tokens,
                "num_preemptions": r.num_preemptions,
                "forked": r.forked,
                "num_image_tokens": sum(span[1] for span in r.mm_spans),
                "groups": groups,
            }
        )
    return out


def _header(
    snap: KVSnapshot, per_group: np.ndarray, ref: np.ndarray, group: int | None = None
) -> dict:
    return {
        "seq": snap.seq,
        "time": snap.time,
        "num_blocks": snap.num_blocks,
        "block_size": snap.block_size,
        "counters": counters(snap, ref),
        "kv_cache_groups": kv_cache_groups(snap, per_group, ref),
        "requests": _requests(snap, group),
        "waiting": [{"request_id": rid, "num_preemptions": n} for rid, n in snap.waiting],
        "tier_loading": list(snap.tier_loading),
        "swapped_out": [  # their KV is in the tier, not the pool (state: out, loading, ready)
            {"request_id": rid, "state": state, "num_blocks": n}
            for rid, state, n in snap.swapped_out
        ],
        "block_marks": block_marks(snap),
    }


def snapshot_payload(snap: KVSnapshot, group: int | None = None) -> dict:
    """GET /kv/snapshot: plain lists, one entry per physical block."""
    per_group = group_ref_counts(snap)
    ref = ref_counts(snap, per_group)
    body = _header(snap, per_group, ref, group)
    body["ref_cnt"] = ref.tolist()
    body["hashed"] = [int(t != 0) for t in snap.hash_tags]
    body["hash_group"] = hash_groups(snap).tolist()
    return body


def events_between(prev: KVSnapshot, cur: KVSnapshot) -> list[dict]:
    """Preemptions, prefix-cache hits, evictions and window frees since the previous snapshot."""
    events = []
    prev_running = {r.request_id for r in prev.requests}
    waiting_ids = {rid for rid, _ in cur.waiting}
    for rid in sorted(prev_running & waiting_ids):
        events.append({"type": "preemption", "request_id": rid})
    for r in cur.requests:
        if r.request_id in prev_running or r.num_cached_tokens <= 0:
            continue
        num_hit = r.num_cached_tokens // cur.block_size
        hit = [b for t in r.tables for b in np.asarray(t[:num_hit]).tolist() if b >= 0]
        events.append(
            {
                "type": "prefix_hit",
                "request_id": r.request_id,
                "num_blocks": len(hit),
                "block_ids": hit[:MAX_EVENT_BLOCK_IDS],
            }
        )
    num_evicted = cur.num_evictions_total - prev.num_evictions_total
    if num_evicted > 0:
        # A block whose hash tag changed or went away lost its cached content; the counter is
        # exact, the ids are what two snapshots can tell apart.
        prev_tags = np.frombuffer(prev.hash_tags, dtype=np.uint8)
        tags = np.frombuffer(cur.hash_tags, dtype=np.uint8)
        lost = np.flatnonzero((prev_tags != 0) & (tags != prev_tags))
        ids = lost[:MAX_EVENT_BLOCK_IDS].tolist()
        events.append({"type": "eviction", "num_blocks": num_evicted, "block_ids": ids})
    window_free = _window_free(prev, cur)
    if window_free:
        events.append(window_free)
    events += _fork_and_tier_events(prev, cur)
    extra = (cur.num_preemptions_total - prev.num_preemptions_total) - sum(
        e["type"] == "preemption" for e in events
    )
    if extra > 0:  # preempted and resumed between two snapshots: counted, not named
        events.append({"type": "preemption", "request_id": None, "count": extra})
    return events


def _fork_and_tier_events(prev: KVSnapshot, cur: KVSnapshot) -> list[dict]:
    """Forks, copy-on-write copies and tier hits since the previous snapshot: exact counts
    (the engine's counters), the ids of the marked blocks that are new."""
    events = []
    num_forks = cur.num_forks_total - prev.num_forks_total
    if num_forks > 0:
        events.append({"type": "fork", "count": num_forks})
    num_copies = cur.num_cow_copies_total - prev.num_cow_copies_total
    if num_copies > 0:
        new = sorted(set(cur.cow_blocks) - set(prev.cow_blocks))
        events.append({"type": "cow", "num_blocks": num_copies, "block_ids": new})
    num_hit = cur.kv_tier_hit_tokens_total - prev.kv_tier_hit_tokens_total
    if num_hit > 0:
        new = sorted(set(cur.tier_blocks) - set(prev.tier_blocks))
        events.append({"type": "tier_hit", "num_tokens": num_hit, "block_ids": new})
    return events


def _window_free(prev: KVSnapshot, cur: KVSnapshot) -> dict | None:
    """Blocks sliding groups returned to the pool: the count is exact (the engine's counter),
    the ids are those both snapshots saw in a running request's table."""
    before, after = prev.num_window_freed_blocks_total, cur.num_window_freed_blocks_total
    if not after or len(before) != len(after) or sum(after) == sum(before):
        return None
    per_group = [a - b for a, b in zip(after, before)]
    prev_tables = {(r.request_id, r.num_preemptions): r.tables for r in prev.requests}
    ids: list[int] = []
    for r in cur.requests:
        old = prev_tables.get((r.request_id, r.num_preemptions))
        if old is None:
            continue
        for g, window in enumerate(cur.group_windows):
            if window and len(ids) < MAX_EVENT_BLOCK_IDS:
                start, end = num_skipped(old[g]), min(num_skipped(r.tables[g]), len(old[g]))
                ids += np.asarray(old[g][start:end]).tolist()
    return {
        "type": "window_free",
        "num_blocks": sum(per_group),
        "num_blocks_per_group": per_group,
        "block_ids": ids[:MAX_EVENT_BLOCK_IDS],
    }


class StreamEncoder:
    """Turns successive snapshots into one client's SSE events (full first, then changes)."""

    def __init__(self, group: int | None = None) -> None:
        self.group = group  # only this group's tables in `requests[].groups` (None: all)
        self.prev: KVSnapshot | None = None
        self.prev_codes: np.ndarray | None = None

    def encode(self, snap: KVSnapshot) -> str:
        per_group = group_ref_counts(snap)
        ref = ref_counts(snap, per_group)
        codes = block_codes(snap, ref)
        body = _header(snap, per_group, ref, self.group)
        prev, prev_codes = self.prev, self.prev_codes
        if prev is None or prev.num_blocks != snap.num_blocks:
            kind = "snapshot"
            body["blocks"] = base64.b64encode(codes.tobytes()).decode()
            body["events"] = []
        else:
            kind = "update"
            body["events"] = events_between(prev, snap)
            changed = np.flatnonzero(codes != prev_codes)
            if len(changed) * FULL_UPDATE_FRACTION > snap.num_blocks:
                body["blocks"] = base64.b64encode(codes.tobytes()).decode()
            else:
                pairs = np.stack([changed, codes[changed]], axis=1).ravel()
                body["changes"] = pairs.tolist()
        self.prev, self.prev_codes = snap, codes
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


class _Latest:
    """The newest snapshot for one consumer; older ones are dropped, never queued."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.snapshot: KVSnapshot | None = None
        self.event = asyncio.Event()

    def offer(self, snap: KVSnapshot) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self._set, snap)

    def _set(self, snap: KVSnapshot) -> None:
        self.snapshot = snap
        self.event.set()

    async def next(self, timeout: float) -> KVSnapshot | None:
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        self.event.clear()
        return self.snapshot


async def next_snapshot(view: KVView, timeout: float = 10.0) -> KVSnapshot:
    latest = _Latest(asyncio.get_running_loop())
    token = view.subscribe(latest.offer)
    try:
        snap = await latest.next(timeout)
    finally:
        view.unsubscribe(token)
    if snap is None:
        raise TimeoutError("the engine loop published no KV snapshot")
    return snap


async def stream_events(
    view: KVView, is_draining, group: int | None = None
) -> AsyncIterator[str]:
    latest = _Latest(asyncio.get_running_loop())
    encoder = StreamEncoder(group)
    token = view.subscribe(latest.offer)
    try:
        yield "retry: 1000\n\n"
        last_sent = time.monotonic()
        while not is_draining():  # checked every second: a drain must not wait on a viewer
            snap = await latest.next(1.0)
            if snap is not None:
                yield await asyncio.to_thread(encoder.encode, snap)
            elif time.monotonic() - last_sent >= KEEPALIVE_S:
                yield ": keepalive\n\n"
            else:
                continue
            last_sent = time.monotonic()
    finally:
        view.unsubscribe(token)


GROUP_QUERY = Query(
    None,
    description="Only this KV cache group's block tables in `requests[].groups` (0-based; "
    "default: every group). `block_table` is always group 0's.",
)


def parse_group(view: KVView, group: str | None) -> int | None:
    """The `group` query parameter: None, or a group index of the served model (else 400)."""
    if group is None:
        return None
    num_groups = view.scheduler.kv_cache_manager.num_groups
    try:
        index = int(group)
    except ValueError:
        index = -1
    if not 0 <= index < num_groups:
        msg = f"group must be an integer from 0 to {num_groups - 1} (this model has "
        msg += f"{num_groups} KV cache group{'s' if num_groups > 1 else ''})"
        raise APIError(400, msg, param="group")
    return index


def build_kv_router(view: KVView) -> APIRouter:
    router = APIRouter(tags=["kv cache"])

    @router.get("/kv/snapshot", summary="The paged KV cache now: blocks, ref counts, tables")
    async def kv_snapshot(group: str | None = GROUP_QUERY) -> dict:
        """Every physical block's `ref_cnt`, `hashed` flag (1: holds a prefix-cache hash) and
        `hash_group`, each running request's `block_table` (logical block i -> physical block,
        group 0) and its table per KV cache group in `groups` (-1: slid out of the window),
        `num_computed_tokens`, `kv_cache_groups`, the head of the waiting queue and the
        counters."""
        index = parse_group(view, group)
        snap = await next_snapshot(view)
        return await asyncio.to_thread(snapshot_payload, snap, index)

    @router.get(
        "/kv/stream",
        summary="Server-sent events of KV cache changes, at most 10 per second",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def kv_stream(request: Request, group: str | None = GROUP_QUERY) -> StreamingResponse:
        """`event: snapshot` first (every block as base64 codes, see the module docs), then
        `event: update` with `changes` ([block_id, code, ...]) or `blocks`, `requests`,
        `kv_cache_groups`, `counters` and `events` (preemption, prefix_hit, eviction,
        window_free, fork, cow, tier_hit)."""
        index = parse_group(view, group)
        is_draining = getattr(request.app.state, "is_draining", lambda: False)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            stream_events(view, is_draining, index),
            media_type="text/event-stream",
            headers=headers,
        )

    return router
