"""engine/core/kv_view.py and server/kv_api.py: snapshots agree with the block pool, rates hold."""

from __future__ import annotations

import base64
import json
import time

import numpy as np
from conftest import make_request, make_scheduler, run_fake_step

from engine.core.kv_view import BlockTableCopies, KVView, take_snapshot
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


# ---- KV cache groups: one table per group, blocks behind the window --------------------------
def _group_scheduler(windows: tuple[int, ...], num_blocks: int = 40, chunk: int = 64):
    from engine.config import EngineConfig
    from engine.core.scheduler import Scheduler

    cfg = EngineConfig(
        block_size=4, max_num_seqs=4, max_num_batched_tokens=chunk, max_model_len=256
    )
    return Scheduler(cfg, num_blocks, windows)


def _engine_tables(sched, request_id: str) -> list[list[int]]:
    """The manager's tables of one request with slid-out entries as -1 (from the blocks)."""
    return [
        [-1 if b is None else b.block_id for b in g.req_to_blocks.get(request_id, [])]
        for g in sched.kv_cache_manager.groups
    ]


def _group_truth(sched) -> list[dict]:
    """Per group from the engine: distinct real blocks held, prefix-cache entries by key."""
    kv = sched.kv_cache_manager
    cached = kv.block_pool.cached_block_hash_to_block
    out = []
    for g in kv.groups:
        held = {b.block_id for bs in g.req_to_blocks.values() for b in bs if b is not None}
        mine = [blk for key, blk in cached.items() if (key[32:] == g.key_suffix)]
        out.append(
            {
                "num_held_blocks": len(held),
                "num_hashed_blocks": len(mine),
                "num_cached_blocks": sum(blk.ref_cnt == 0 for blk in mine),
                "num_window_freed_blocks_total": g.num_window_freed_blocks_total,
            }
        )
    return out


def test_group_tables_mark_blocks_behind_the_window_and_never_count_them():
    """A sliding-only model: the engine's placeholder is id 0, a real block too. The view
    marks placeholders -1, so block 0 held by another request gets its true ref count."""
    sched = _group_scheduler((8,), num_blocks=8, chunk=16)
    # 54 tokens need 14 blocks of 4 over time: the pool of 8 wraps round, so block 0 slides
    # out of a's window and comes back as a newer block of a's own table
    sched.add_request(make_request("a", 14, max_tokens=40))
    view = KVView(sched)
    block0_held_beside_a_placeholder = 0
    for _ in range(60):
        snap = view.capture_now()
        assert ref_counts(snap).tolist() == _pool_truth(sched)[0]
        for r in snap.requests:
            assert [t.tolist() for t in r.tables] == _engine_tables(sched, r.request_id)
        ids = [t.tolist() for r in snap.requests for t in r.tables]
        if any(0 in t for t in ids) and any(-1 in t for t in ids):
            block0_held_beside_a_placeholder += 1
        if not sched.has_unfinished_requests():
            break
        run_fake_step(sched)
        sched.kv_cache_manager.check_integrity()
    assert block0_held_beside_a_placeholder > 0, "the case the marking exists for happened"


def test_two_groups_sliding_table_stops_growing_while_the_full_one_grows():
    sched = _group_scheduler((0, 8))
    sched.add_request(make_request("a", 20, max_tokens=30))
    view = KVView(sched)
    held = []
    taken = []
    for _ in range(25):
        run_fake_step(sched)
        snap = view.capture_now()
        (r,) = snap.requests
        assert [t.tolist() for t in r.tables] == _engine_tables(sched, "a")
        assert r.block_table.tolist() == r.tables[0].tolist()  # block_table is group 0's
        taken.append((snap, [t.tolist() for t in r.tables]))
        # no prefix hit: every slid-out entry is a block this request held and gave back
        assert snap.num_window_freed_blocks_total == (0, r.tables[1].tolist().count(-1))
        held.append([sum(b >= 0 for b in t) for t in r.tables])
    full, sliding = zip(*held)
    assert list(full) == sorted(full) and full[-1] == -(-(20 + 24) // 4)
    # after the prefill step (every prompt block), a window of 8 touches <= cdiv(8 - 1, 4) + 1
    assert sliding[0] == 5 and max(sliding[1:]) <= 3
    for snap, tables in taken:  # marking a copy in place never reaches a snapshot taken
        assert [t.tolist() for t in snap.requests[0].tables] == tables


def test_payload_describes_each_group_as_the_engine_sees_it():
    sched = _group_scheduler((0, 8, 8))
    sched.add_request(make_request("first", 21, max_tokens=1))
    for _ in range(3):
        run_fake_step(sched)
    sched.add_request(make_request("a", 23, max_tokens=12))  # hits first's last window
    sched.add_request(make_request("b", 17, max_tokens=12, start=400))
    for _ in range(7):
        run_fake_step(sched)
    body = json.loads(json.dumps(snapshot_payload(take_snapshot(sched))))
    groups = body["kv_cache_groups"]
    assert [(g["group"], g["kind"], g["window"]) for g in groups] == [
        (0, "full", 0),
        (1, "sliding", 8),
        (2, "sliding", 8),
    ]
    truth = _group_truth(sched)
    for g, want in zip(groups, truth):
        assert {k: g[k] for k in want} == want
    assert truth[1]["num_window_freed_blocks_total"] > 0 and truth[0]["num_hashed_blocks"] > 0
    c = body["counters"]
    num_freed = sum(t["num_window_freed_blocks_total"] for t in truth)
    assert c["num_window_freed_blocks_total"] == num_freed
    assert c["num_used_blocks"] == sum(body["ref_cnt"][b] > 0 for b in range(40))
    for r in body["requests"]:
        tables = _engine_tables(sched, r["request_id"])
        assert [g["block_table"] for g in r["groups"]] == tables
        assert [g["num_skipped_blocks"] for g in r["groups"]] == [t.count(-1) for t in tables]
        assert r["block_table"] == tables[0]
    assert sum(g["num_skipped_blocks"] for g in groups) == sum(
        g["num_skipped_blocks"] for r in body["requests"] for g in r["groups"]
    )
    # hash_group: each hashed block's group is the one whose key it was cached under
    kv = sched.kv_cache_manager
    by_block = {
        blk.block_id: next(g.index for g in kv.groups if key[32:] == g.key_suffix)
        for key, blk in kv.block_pool.cached_block_hash_to_block.items()
    }
    assert body["hash_group"] == [by_block.get(b, -1) for b in range(40)]
    assert sum(hg >= 0 for hg in body["hash_group"]) == sum(body["hashed"])
    a = next(r for r in body["requests"] if r["request_id"] == "a")
    assert a["num_cached_tokens"] == 20 and a["groups"][1]["block_table"][0] == -1


def test_group_filter_shows_one_groups_tables():
    sched = _group_scheduler((0, 8))
    sched.add_request(make_request("a", 20, max_tokens=10))
    for _ in range(4):
        run_fake_step(sched)
    snap = take_snapshot(sched)
    body = snapshot_payload(snap, group=1)
    (r,) = body["requests"]
    assert [g["group"] for g in r["groups"]] == [1]
    assert r["groups"][0]["block_table"] == _engine_tables(sched, "a")[1]
    assert r["block_table"] == _engine_tables(sched, "a")[0]
    _, ev = _parse(StreamEncoder(group=0).encode(snap))
    assert [g["group"] for g in ev["requests"][0]["groups"]] == [0]
    assert len(ev["kv_cache_groups"]) == 2


def test_stream_rebuilds_a_hybrid_pool_and_counts_every_window_free():
    """Two groups, a tight pool: preemptions, hits, evictions and blocks sliding out."""
    sched = _group_scheduler((0, 8), num_blocks=20, chunk=16)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 14, max_tokens=24, start=100 * i))
    enc = StreamEncoder()
    tables = BlockTableCopies()
    codes = None
    events = []
    for _ in range(200):
        snap = take_snapshot(sched, seq=len(events), tables=tables)
        for r in snap.requests:
            assert [t.tolist() for t in r.tables] == _engine_tables(sched, r.request_id)
        _, body = _parse(enc.encode(snap))
        events += body["events"]
        codes = _decode(body, codes)
        ref, hashed = _pool_truth(sched)
        assert codes.tolist() == [min(r, 127) | (h << 7) for r, h in zip(ref, hashed)]
        if not sched.has_unfinished_requests():
            break
        run_fake_step(sched)
        sched.kv_cache_manager.check_integrity()
    assert not sched.has_unfinished_requests() and sched.num_preemptions_total > 0
    freed = [e for e in events if e["type"] == "window_free"]
    total = sched.kv_cache_manager.groups[1].num_window_freed_blocks_total
    assert total > 0 and sum(e["num_blocks"] for e in freed) == total
    assert all(e["num_blocks_per_group"][0] == 0 for e in freed)
    named = [b for e in freed for b in e["block_ids"]]
    assert named and all(0 <= b < 20 for b in named)
    assert len(named) <= total
