"""The KV view as HTTP: GET /kv/snapshot (JSON) and GET /kv/stream (SSE of changes).

Snapshots come from the engine thread as copies (engine/kv_view.py); everything here runs on
the event loop or in a worker thread, never on the engine thread. Block state in the stream
is one byte per physical block, base64-encoded:

    code = min(ref_cnt, 127) | (128 if the block holds a prefix-cache hash else 0)
    free: code == 0 · cached (evictable): code == 128 · held by requests: code & 127 > 0

The first stream event (`snapshot`) carries every block; later ones (`update`) carry either
the blocks whose code changed as flat [block_id, code, ...] pairs or, when many changed, all
of them again, plus the requests, counters and the events since the previous update.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from engine.kv_view import KVSnapshot, KVView

KEEPALIVE_S = 15.0
MAX_EVENT_BLOCK_IDS = 256  # an event lists at most this many block ids
FULL_UPDATE_FRACTION = 8  # more than 1/8 of the blocks changed: send them all again


def ref_counts(snap: KVSnapshot) -> np.ndarray:
    """Each block's ref count: how many running requests' block tables hold it."""
    tables = [np.asarray(r.block_table, dtype=np.int64) for r in snap.requests]
    if not any(len(t) for t in tables):
        return np.zeros(snap.num_blocks, dtype=np.int32)
    ids = np.concatenate(tables)
    return np.bincount(ids, minlength=snap.num_blocks).astype(np.int32)


def block_codes(snap: KVSnapshot, ref: np.ndarray | None = None) -> np.ndarray:
    ref = ref_counts(snap) if ref is None else ref
    hashed = (np.frombuffer(snap.hash_tags, dtype=np.uint8) != 0).astype(np.uint8)
    return np.minimum(ref, 127).astype(np.uint8) | (hashed << 7)


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
        "prefix_cache_queries_total": queries,
        "prefix_cache_hits_total": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
    }


def _requests(snap: KVSnapshot) -> list[dict]:
    return [
        {
            "request_id": r.request_id,
            "block_table": np.asarray(r.block_table).tolist(),
            "num_computed_tokens": r.num_computed_tokens,
            "num_tokens": r.num_tokens,
            "num_prompt_tokens": r.num_prompt_tokens,
            "num_cached_tokens": r.num_cached_tokens,
            "num_preemptions": r.num_preemptions,
        }
        for r in snap.requests
    ]


def _header(snap: KVSnapshot, ref: np.ndarray) -> dict:
    return {
        "seq": snap.seq,
        "time": snap.time,
        "num_blocks": snap.num_blocks,
        "block_size": snap.block_size,
        "counters": counters(snap, ref),
        "requests": _requests(snap),
        "waiting": [{"request_id": rid, "num_preemptions": n} for rid, n in snap.waiting],
    }


def snapshot_payload(snap: KVSnapshot) -> dict:
    """GET /kv/snapshot: plain lists, one entry per physical block."""
    ref = ref_counts(snap)
    body = _header(snap, ref)
    body["ref_cnt"] = ref.tolist()
    body["hashed"] = [int(t != 0) for t in snap.hash_tags]
    return body


def events_between(prev: KVSnapshot, cur: KVSnapshot) -> list[dict]:
    """Preemptions, prefix-cache hits and evictions since the previous snapshot."""
    events = []
    prev_running = {r.request_id for r in prev.requests}
    waiting_ids = {rid for rid, _ in cur.waiting}
    for rid in sorted(prev_running & waiting_ids):
        events.append({"type": "preemption", "request_id": rid})
    for r in cur.requests:
        if r.request_id in prev_running or r.num_cached_tokens <= 0:
            continue
        hit = np.asarray(r.block_table[: r.num_cached_tokens // cur.block_size]).tolist()
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
    extra = (cur.num_preemptions_total - prev.num_preemptions_total) - sum(
        e["type"] == "preemption" for e in events
    )
    if extra > 0:  # preempted and resumed between two snapshots: counted, not named
        events.append({"type": "preemption", "request_id": None, "count": extra})
    return events


class StreamEncoder:
    """Turns successive snapshots into one client's SSE events (full first, then changes)."""

    def __init__(self) -> None:
        self.prev: KVSnapshot | None = None
        self.prev_codes: np.ndarray | None = None

    def encode(self, snap: KVSnapshot) -> str:
        ref = ref_counts(snap)
        codes = block_codes(snap, ref)
        body = _header(snap, ref)
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


async def stream_events(view: KVView, is_draining) -> AsyncIterator[str]:
    latest = _Latest(asyncio.get_running_loop())
    encoder = StreamEncoder()
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


def build_kv_router(view: KVView) -> APIRouter:
    router = APIRouter(tags=["kv cache"])

    @router.get("/kv/snapshot", summary="The paged KV cache now: blocks, ref counts, tables")
    async def kv_snapshot() -> dict:
        """Every physical block's `ref_cnt` and `hashed` flag (1: holds a prefix-cache hash),
        each running request's `block_table` (logical block i -> physical block) and
        `num_computed_tokens`, the head of the waiting queue and the counters."""
        snap = await next_snapshot(view)
        return await asyncio.to_thread(snapshot_payload, snap)

    @router.get(
        "/kv/stream",
        summary="Server-sent events of KV cache changes, at most 10 per second",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def kv_stream(request: Request) -> StreamingResponse:
        """`event: snapshot` first (every block as base64 codes, see the module docs), then
        `event: update` with `changes` ([block_id, code, ...]) or `blocks`, `requests`,
        `counters` and `events` (preemption, prefix_hit, eviction)."""
        is_draining = getattr(request.app.state, "is_draining", lambda: False)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            stream_events(view, is_draining), media_type="text/event-stream", headers=headers
        )

    return router
