"""The KV view's marks (engine/core/kv_marks.py, server/kv_api.py `block_marks`): blocks shared
by forks, copy-on-write copies, blocks loaded back from the KV tier, blocks holding image
placeholder tokens, the requests' `forked` flag and the counters, each against engine state."""

from __future__ import annotations

import json

from conftest import make_prompts, make_request, make_scheduler, run_fake_step, run_until_done

from engine import LLM, SamplingParams
from engine.core.kv_view import BlockTableCopies, KVView, take_snapshot
from server.kv_api import StreamEncoder, ref_counts, snapshot_payload

BS = 4


def _forked_scheduler(num_blocks: int = 64):
    """s0 (10 tokens) and s1 forked from it (n=2): one step prefills, the next forks."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=BS)
    reqs = [make_request(f"s{i}", 10, max_tokens=6) for i in range(2)]
    reqs[1].fork_parent_id = "s0"
    for req in reqs:
        sched.add_request(req)
    return sched, reqs


def test_forked_requests_share_blocks_and_name_their_copies():
    sched, (parent, child) = _forked_scheduler()
    kv = sched.kv_cache_manager
    tables = BlockTableCopies()
    run_fake_step(sched)
    snap = take_snapshot(sched, tables=tables)
    encoder = StreamEncoder()
    encoder.encode(snap)
    assert snap.num_forks_total == 0 and not snap.cow_blocks
    assert [r.forked for r in snap.requests] == [False]
    out, _ = run_fake_step(sched)  # the fork: the child's write into the partial block copies
    (copy,) = out.block_copies
    snap = take_snapshot(sched, tables=tables)
    body = json.loads(json.dumps(snapshot_payload(snap)))
    assert [r["forked"] for r in body["requests"]] == [True, True]
    shared = [b for b in kv.get_block_ids("s0") if b in kv.get_block_ids("s1")]
    assert len(shared) == 2 and all(body["ref_cnt"][b] == 2 for b in shared)
    assert body["counters"]["num_shared_blocks"] == 2
    assert body["block_marks"]["cow"] == [copy[1]]  # the first writer (s0) copied
    assert kv.get_block_ids("s0")[2] == copy[1] and kv.get_block_ids("s1")[2] == copy[0]
    assert body["counters"]["num_forks_total"] == 1
    assert body["counters"]["num_cow_copies_total"] == kv.num_cow_copies_total == 1
    assert body["counters"]["kv_tier_queries_total"] == -1  # no tier configured
    assert ref_counts(snap).tolist() == [b.ref_cnt for b in kv.block_pool.blocks]
    # the stream carries the same marks and names the fork and the copy; a finished fork's
    # copy loses its mark
    update = json.loads(encoder.encode(snap).split("data: ", 1)[1])
    assert update["block_marks"]["cow"] == [copy[1]]
    events = {e["type"]: e for e in update["events"]}
    assert events["fork"]["count"] == 1
    assert events["cow"] == {"type": "cow", "num_blocks": 1, "block_ids": [copy[1]]}
    run_until_done(sched)
    snap = take_snapshot(sched, tables=tables)
    assert snap.cow_blocks == () and not kv.cow_log
    assert snap.num_cow_copies_total == 1


def test_a_freed_and_reused_copy_is_not_marked():
    sched, _ = _forked_scheduler(num_blocks=12)
    kv = sched.kv_cache_manager
    run_fake_step(sched)
    run_fake_step(sched)
    (entry,) = kv.cow_log
    block_id, rid = entry[0], entry[1]
    run_until_done(sched)
    # another request takes the copy's block from the free queue: no longer a copy
    assert kv.allocate_slots(make_request("x", 12 * BS), 12 * BS) is not None  # every block
    assert block_id in kv.get_block_ids("x") and rid not in kv.req_to_blocks
    assert take_snapshot(sched).cow_blocks == () and not kv.cow_log


def test_tier_hits_are_marked_and_counted(tiny_model_dir, tmp_path):
    llm = LLM(
        str(tiny_model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=32,
        block_size=BS, num_gpu_blocks_override=24, kv_offloading_size=0.01,
        kv_offloading_dir=str(tmp_path),
    )  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = make_prompts(4, min_len=40, max_len=44, seed=3)
    for p in prompts:  # fills the pool: earlier prefixes go to disk
        llm.generate([p], params, use_tqdm=False)
    view = KVView(engine.scheduler)
    tier = engine.kv_offload.tier
    assert view.capture_now().tier_blocks == () and tier.hit_tokens_total == 0
    engine.add(engine.make_request("again", prompts[0] + [5, 6, 7], params))
    loading, marked, encoder, streamed = False, set(), StreamEncoder(), []
    encoder.encode(view.capture_now())
    while engine.has_unfinished_requests():
        engine.step()
        snap = view.capture_now()
        update = json.loads(encoder.encode(snap).split("data: ", 1)[1])
        streamed += [e for e in update["events"] if e["type"] == "tier_hit"]
        loading |= "again" in snap.tier_loading
        mine = [r for r in snap.requests if r.request_id == "again"]
        if mine and snap.tier_blocks:
            assert set(snap.tier_blocks) <= set(mine[0].block_table.tolist())
            marked |= set(snap.tier_blocks)
            body = snapshot_payload(snap)
            assert body["block_marks"]["tier"] == sorted(snap.tier_blocks)
            assert body["counters"]["kv_tier_hit_tokens_total"] == tier.hit_tokens_total > 0
    assert loading, "the request waited for its tier loads and the snapshot said so"
    assert len(marked) * BS == tier.hit_tokens_total
    assert sum(e["num_tokens"] for e in streamed) == tier.hit_tokens_total
    assert {b for e in streamed for b in e["block_ids"]} == marked
    llm.engine.shutdown()


def test_image_blocks_are_marked(tmp_path):
    from test_multimodal import build_tiny_llava_dir, image_prompt, make_engine, random_image

    engine = make_engine(build_tiny_llava_dir(tmp_path / "llava"), block_size=BS)
    view = KVView(engine.scheduler)
    ids, inputs = image_prompt(engine, "describe", [random_image(5)])
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add(engine.make_request("img", ids, params, inputs))
    engine.add(engine.make_request("txt", list(range(10, 30)), params))
    seen = False
    while engine.has_unfinished_requests():
        engine.step()
        snap = view.capture_now()
        req = engine.scheduler.requests.get("img")
        if req is None or not snap.requests:
            continue
        ((start, length, _),) = req.mm_spans
        body = snapshot_payload(snap)
        table = next(r for r in body["requests"] if r["request_id"] == "img")["block_table"]
        want = table[start // BS : (start + length - 1) // BS + 1]
        assert body["block_marks"]["image"] == sorted(want) and want
        txt = [r for r in body["requests"] if r["request_id"] == "txt"]
        assert not txt or not set(txt[0]["block_table"]) & set(want)
        assert (
            next(r for r in body["requests"] if r["request_id"] == "img")["num_image_tokens"]
            == length
        )
        seen = True
    assert seen
