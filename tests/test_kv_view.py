"""engine/kv_view.py and server/kv_api.py: snapshots agree with the block pool, rates hold."""

from __future__ import annotations

import base64
import json
import time

import numpy as np
from conftest import make_request, make_scheduler, run_fake_step

from engine.kv_view import BlockTableCopies, KVView, take_snapshot
from server.kv_api import StreamEncoder, block_codes, ref_counts, snapshot_payload


def _pool_truth(scheduler):
    pool = scheduler.kv_cache_manager.block_pool
    ref = [b.ref_cnt for b in pool.blocks]
    hashed = [int(b.block_hash is not None) for b in pool.blocks]
    return ref, hashed


def _shared_prefix_scheduler():
    """Two running requests share a 12-token prefix (3 blocks of 4) with a finished one."""
    sched = make_scheduler(num_blocks=32, block_size=4)
    sched.add_request(make_request("first", 20, max_tokens=1))
    for _ in range(4):
        run_fake_step(sched)
    sched.add_request(make_request("a", 14, max_tokens=20))
    sched.add_request(make_request("b", 14, max_tokens=20))
    for _ in range(3):
        run_fake_step(sched)
    return sched


def test_snapshot_matches_the_pool_ref_counts_hashes_and_tables():
    sched = _shared_prefix_scheduler()
    snap = take_snapshot(sched, seq=1)
    ref, hashed = _pool_truth(sched)
    assert ref_counts(snap).tolist() == ref
    assert [int(t != 0) for t in snap.hash_tags] == hashed
    assert max(ref) == 2, "the shared prefix blocks are held twice"
    kv = sched.kv_cache_manager
    for r in snap.requests:
        assert r.block_table.tolist() == kv.get_block_ids(r.request_id)
        assert r.num_computed_tokens == sched.requests[r.request_id].num_computed_tokens
    assert {r.request_id for r in snap.requests} == {"a", "b"}
    assert [r.num_cached_tokens for r in snap.requests] == [12, 12]


def test_snapshot_is_a_copy_not_live_state():
    sched = _shared_prefix_scheduler()
    snap = take_snapshot(sched)
    before = [r.block_table.tolist() for r in snap.requests], bytes(snap.hash_tags)
    for _ in range(8):
        run_fake_step(sched)
    assert ([r.block_table.tolist() for r in snap.requests], bytes(snap.hash_tags)) == before
    assert [r.block_table.tolist() for r in snap.requests] != [
        sched.kv_cache_manager.get_block_ids(r.request_id) for r in snap.requests
    ]


def test_incremental_table_copies_never_change_a_snapshot_already_taken():
    sched = _shared_prefix_scheduler()
    view = KVView(sched)
    kv = sched.kv_cache_manager
    taken = []
    for _ in range(12):  # tables grow a block every 4 steps, in the same buffers
        snap = view.capture_now()
        taken.append((snap, [r.block_table.tolist() for r in snap.requests]))
        assert taken[-1][1] == [kv.get_block_ids(r.request_id) for r in snap.requests]
        run_fake_step(sched)
    for snap, tables in taken:
        assert [r.block_table.tolist() for r in snap.requests] == tables


def test_payload_counters_and_codes():
    sched = _shared_prefix_scheduler()
    snap = take_snapshot(sched)
    body = json.loads(json.dumps(snapshot_payload(snap)))
    pool = sched.kv_cache_manager.block_pool
    c = body["counters"]
    assert c["num_used_blocks"] == pool.num_blocks - pool.get_num_free_blocks()
    assert c["num_cached_blocks"] == pool.get_num_cached_free_blocks() > 0
    assert c["num_free_blocks"] + c["num_cached_blocks"] + c["num_used_blocks"] == 32
    assert c["num_shared_blocks"] == 3 and c["num_running"] == 2
    assert body["ref_cnt"] == _pool_truth(sched)[0]
    codes = block_codes(snap)
    for ref, hashed, code in zip(body["ref_cnt"], body["hashed"], codes.tolist()):
        assert code == min(ref, 127) | (hashed << 7)


def _decode(body: dict, codes: np.ndarray | None) -> np.ndarray:
    if "blocks" in body:
        return np.frombuffer(base64.b64decode(body["blocks"]), dtype=np.uint8).copy()
    pairs = np.asarray(body["changes"], dtype=np.int64).reshape(-1, 2)
    codes = codes.copy()
    codes[pairs[:, 0]] = pairs[:, 1]
    return codes


def _parse(event: str) -> tuple[str, dict]:
    kind = event.split("\n", 1)[0].removeprefix("event: ")
    return kind, json.loads(event.split("data: ", 1)[1])


def test_stream_updates_rebuild_the_pool_exactly_and_name_preemptions():
    """A pool of 12 blocks of 4 and three growing requests: preemption, eviction, hits."""
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=64)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 10, max_tokens=12, start=100 * i))
    enc = StreamEncoder()
    tables = BlockTableCopies()  # shared across captures: tables grow, reset on preemption
    codes = None
    kinds, events = [], []
    for _ in range(60):
        snap = take_snapshot(sched, seq=len(kinds), tables=tables)
        kv = sched.kv_cache_manager
        assert [r.block_table.tolist() for r in snap.requests] == [
            kv.get_block_ids(r.request_id) for r in snap.requests
        ]
        kind, body = _parse(enc.encode(snap))
        kinds.append(kind)
        events += body["events"]
        codes = _decode(body, codes)
        ref, hashed = _pool_truth(sched)
        assert codes.tolist() == [min(r, 127) | (h << 7) for r, h in zip(ref, hashed)]
        if not sched.has_unfinished_requests():
            break
        run_fake_step(sched)
    assert kinds[0] == "snapshot" and set(kinds[1:]) == {"update"}
    assert sched.num_preemptions_total > 0
    named = [e for e in events if e["type"] == "preemption"]
    assert sum(e.get("count", 1) for e in named) == sched.num_preemptions_total
    assert any(e["request_id"] for e in named), "a preempted request is named"


def test_prefix_hit_and_eviction_events():
    sched = make_scheduler(num_blocks=8, block_size=4)
    sched.add_request(make_request("a", 13, max_tokens=1))
    enc = StreamEncoder()
    enc.encode(take_snapshot(sched))
    run_fake_step(sched)  # a finishes; its 3 full blocks stay cached
    enc.encode(take_snapshot(sched))
    sched.add_request(make_request("b", 13, max_tokens=4))
    run_fake_step(sched)
    _, body = _parse(enc.encode(take_snapshot(sched)))
    hit = [e for e in body["events"] if e["type"] == "prefix_hit"]
    assert hit and hit[0]["request_id"] == "b" and hit[0]["num_blocks"] == 3
    run_fake_step(sched)
    _, body = _parse(enc.encode(take_snapshot(sched)))
    assert not [e for e in body["events"] if e["type"] == "prefix_hit"], "a hit is told once"
    for _ in range(5):
        run_fake_step(sched)
    enc.encode(take_snapshot(sched))  # b finished: 4 cached free blocks, 4 never used
    sched.add_request(make_request("c", 28, max_tokens=1, start=500))  # needs all 8 blocks
    run_fake_step(sched)
    _, body = _parse(enc.encode(take_snapshot(sched)))
    evicted = [e for e in body["events"] if e["type"] == "eviction"]
    # c takes the 4 unused blocks first, then evicts from the tail of b's chain (freed first)
    assert evicted == [{"type": "eviction", "num_blocks": 3, "block_ids": [1, 2, 3]}]
    assert body["counters"]["num_evictions_total"] == 3


def test_view_captures_only_with_subscribers_and_within_the_rate():
    sched = _shared_prefix_scheduler()
    view = KVView(sched, max_updates_per_s=5.0)
    seen = []
    for _ in range(50):
        view.on_step(0, 0)
    assert view.capture_now().seq == 1 and not seen, "nobody subscribed: no capture"
    token = view.subscribe(seen.append)
    start = time.monotonic()
    while time.monotonic() - start < 1.0:  # bounded: one second of steps
        run_fake_step(sched)
        view.on_step(0, 0)
    elapsed = time.monotonic() - start
    assert 2 <= len(seen) <= 5 * elapsed + 1
    view.unsubscribe(token)
    n = len(seen)
    view.on_step(0, 0)
    time.sleep(0.25)
    view.on_step(0, 0)
    assert len(seen) == n


def test_idle_view_publishes_the_change_the_rate_held_back():
    sched = _shared_prefix_scheduler()
    view = KVView(sched, max_updates_per_s=4.0)
    seen = []
    view.subscribe(seen.append)
    view.on_idle()
    assert len(seen) == 1, "a new subscriber is served at once"
    sched.finish_requests(["a", "b"], sched.requests["a"].status.FINISHED_ABORTED)
    view.on_idle()
    assert len(seen) == 1, "not due yet"
    timeout = view.idle_timeout(0.5)
    assert 0 < timeout <= 0.25
    time.sleep(timeout)
    view.on_idle()
    assert len(seen) == 2 and seen[-1].requests == []
    view.on_idle()
    assert len(seen) == 2, "nothing changed: nothing published"


def test_prefix_totals_accumulate_across_steps():
    view = KVView(make_scheduler())
    view.on_step(10, 4)
    view.on_step(6, 0)
    snap = view.capture_now()
    assert (snap.prefix_cache_queries_total, snap.prefix_cache_hits_total) == (16, 4)
