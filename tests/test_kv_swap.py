"""Swap preemption (engine/core/kv_swap.py): a preempted request's KV blocks go to the KV tier
and come back on resume instead of being recomputed; greedy float32 output equals transformers';
the resumed request computes no token twice; no block leaks; aborts in every swap state."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import hf_greedy, make_prompts, metric_value

from engine import LLM, SamplingParams
from engine.core.kv_swap import SWAP_MIN_TOKENS, KVSwap
from engine.kv_offload.disk_store import DiskKVStore

BS = 4
MAX_NEW = 24
NUM_BLOCKS = 30  # 120 tokens: each request needs ~17 blocks at the end, three do not fit
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _llm(model_dir, tier_dir, caching: bool = True, **kw) -> LLM:
    return LLM(
        str(model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=32,
        block_size=BS, num_gpu_blocks_override=NUM_BLOCKS, enable_prefix_caching=caching,
        kv_offloading_size=0.01, kv_offloading_dir=str(tier_dir), **kw,
    )  # fmt: skip


def _count_computed(llm) -> list[int]:
    """Every token scheduled (prompt and output), summed over steps."""
    sched = llm.engine.scheduler
    counted = [0]
    schedule = sched.schedule

    def counting():
        out = schedule()
        counted[0] += sum(out.num_scheduled_tokens)
        return out

    sched.schedule = counting
    return counted


def _assert_all_free(llm) -> None:
    sched = llm.engine.scheduler
    kv = sched.kv_cache_manager
    kv.check_integrity()
    assert not sched.kv_swap.entries and not sched.kv_swap.num_loading
    assert not kv.req_to_blocks and kv.block_pool.get_num_free_blocks() == kv.num_blocks
    store = llm.engine.kv_offload.store
    assert store.swap_bytes == 0 and not store._swap_pending and not store._swap_files


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(3, min_len=40, max_len=44, seed=5)


def _integrity_every_step(llm) -> None:
    engine = llm.engine
    step = engine.step

    def checked():
        result = step()
        engine.scheduler.kv_cache_manager.check_integrity()
        return result

    engine.step = checked


@pytest.mark.parametrize("caching", [False, True])
def test_swapped_requests_resume_from_the_tier_equal_to_transformers(
    tiny_model_dir, tmp_path, prompts, caching
):
    ref = hf_greedy(tiny_model_dir, prompts, MAX_NEW)
    llm = _llm(tiny_model_dir, tmp_path, caching)
    swap = llm.engine.scheduler.kv_swap
    swap.min_tokens = 0  # every preemption swaps
    counted = _count_computed(llm)
    _integrity_every_step(llm)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    sched = llm.engine.scheduler
    assert sched.num_preemptions_total >= 1
    assert swap.num_swapped_out_total == sched.num_preemptions_total
    assert swap.num_recomputed_total == 0
    assert swap.in_blocks_total > 0  # blocks came back from the tier
    if not caching:  # nothing stays cached in the pool: every swapped block is loaded
        assert swap.in_blocks_total == swap.out_blocks_total
    assert swap.in_blocks_total + swap.pool_blocks_total == swap.out_blocks_total
    # Each request computed each token once: its prompt, then one token per new token but the last.
    assert counted[0] == sum(len(p) + MAX_NEW - 1 for p in prompts)
    _assert_all_free(llm)
    _check_metrics(llm)
    llm.engine.shutdown()


def test_recompute_below_the_threshold_and_when_the_tier_is_full(tiny_model_dir, tmp_path, prompts):
    ref = hf_greedy(tiny_model_dir, prompts, MAX_NEW)
    llm = _llm(tiny_model_dir, tmp_path)
    swap = llm.engine.scheduler.kv_swap
    assert swap.min_tokens == SWAP_MIN_TOKENS
    swap.min_tokens = None  # never: the recompute baseline
    counted = _count_computed(llm)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert swap.num_swapped_out_total == 0 and swap.num_recomputed_total >= 1
    assert counted[0] > sum(len(p) + MAX_NEW - 1 for p in prompts)  # preempted tokens again
    # A tier with no room for a victim's blocks: recompute again.
    swap.min_tokens = 0
    llm.engine.kv_offload.store.capacity_bytes = swap.block_bytes  # one block
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert swap.num_swapped_out_total == 0
    _assert_all_free(llm)
    llm.engine.shutdown()


class GatedDisk(DiskKVStore):
    """Swap writes land; reads of swap files wait for the gate (a slow disk)."""

    gate = threading.Event()

    def read_file(self, path):
        if path.suffix == ".swap":
            self.gate.wait(30)  # a step that waits on it takes 30 s
        return super().read_file(path)


def _step_until(engine, done: dict, until, max_s: float = 60.0) -> float:
    """Steps until until() holds, checking integrity; returns the slowest step's seconds."""
    slowest, deadline = 0.0, time.monotonic() + max_s
    while not until() and time.monotonic() < deadline:
        t0 = time.monotonic()
        outputs, _ = engine.step()
        slowest = max(slowest, time.monotonic() - t0)
        engine.scheduler.kv_cache_manager.check_integrity()
        for o in outputs:  # streamed deltas
            done.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            done.setdefault("finished", []).extend([o.request_id] if o.finished else [])
    assert until(), "timed out"
    return slowest


def test_abort_while_swapped_out_loading_and_loaded(tiny_model_dir, tmp_path, prompts):
    from engine.kv_offload.setup import attach_kv_offload

    llm = _llm(tiny_model_dir, tmp_path, caching=False)
    engine = llm.engine
    engine.kv_offload.shutdown()
    engine.kv_offload = attach_kv_offload(engine, store_cls=GatedDisk)
    sched = engine.scheduler
    swap = sched.kv_swap
    swap.min_tokens = 0
    store = engine.kv_offload.store
    GatedDisk.gate.clear()
    resume = swap.resume

    def resume_from_disk(req):  # the writes land first, so the loads read the (gated) files
        while store._swap_pending:
            time.sleep(0.001)
        return resume(req)

    swap.resume = resume_from_disk
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, PARAMS)
    done: dict[str, list[int]] = {}
    _step_until(engine, done, lambda: bool(swap.entries))  # someone is swapped out
    victim = next(iter(swap.entries))
    assert swap.entries[victim].state == "out"
    engine.abort_request([victim])  # (1) swapped out: its swap entries go
    assert not swap.entries or victim not in swap.entries
    # (2) a resume waits on the disk (its write landed first), and no step waits with it
    slowest = _step_until(engine, done, lambda: swap.num_loading > 0)
    assert slowest < 10.0  # a step that waited on the held-back disk would take 30 s
    loading = next(r for r, e in swap.entries.items() if e.state == "loading")
    held = len(swap.entries[loading].blocks)
    engine.abort_request([loading])
    steps = [0]
    _step_until(engine, done, lambda: (steps.__setitem__(0, steps[0] + 1), steps[0] > 2)[1])
    sched.kv_cache_manager.check_integrity()  # the loading blocks are still held
    assert swap.held_blocks() and len(swap.held_blocks()) >= held
    GatedDisk.gate.set()
    _step_until(engine, done, lambda: not sched.has_unfinished_requests())
    (kept,) = {"r0", "r1", "r2"} - {victim, loading}
    assert done["finished"] == [kept]  # the aborted ones report nothing more
    assert done[kept] == hf_greedy(tiny_model_dir, [prompts[int(kept[1])]], MAX_NEW)[0]
    assert not swap.entries and store.swap_bytes == 0
    assert not list(store.directory.glob("*.swap"))  # read once, or deleted when dropped
    _assert_all_free(llm)
    engine.shutdown()


def test_failed_swap_load_recomputes_from_there(tiny_model_dir, tmp_path, prompts):
    ref = hf_greedy(tiny_model_dir, prompts, MAX_NEW)
    llm = _llm(tiny_model_dir, tmp_path, caching=False)
    swap = llm.engine.scheduler.kv_swap
    swap.min_tokens = 0
    store = llm.engine.kv_offload.store
    real = store.submit_load

    def lose_every_third(tag, key, n=[0]):  # noqa: B006 - a counter
        n[0] += 1
        if n[0] % 3 == 0:  # a lost file: the load reports failure
            store.drop_swap(key)
            with store._lock:
                store._results.append((tag, None))
            return
        real(tag, key)

    store.submit_load = lose_every_third
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert swap.num_failed_loads_total > 0
    llm.engine.shutdown()


def _check_metrics(llm: LLM) -> None:
    from server.metrics import Metrics

    metrics = Metrics("m")
    metrics.watch_kv_memory(llm.engine)
    text = metrics.render().decode()
    swap: KVSwap = llm.engine.scheduler.kv_swap
    expect = {
        "pagedserve:kv_swap_out_blocks_total": swap.out_blocks_total,
        "pagedserve:kv_swap_in_blocks_total": swap.in_blocks_total,
        "pagedserve:kv_swap_preemptions_total": swap.num_swapped_out_total,
        "pagedserve:kv_swapped_requests": 0,
    }
    for name, value in expect.items():
        assert metric_value(text, name, {"model_name": "m"}) == value, name
    assert swap.out_blocks_total > 0


def test_the_kv_view_lists_swapped_out_requests(tiny_model_dir, tmp_path, prompts):
    from engine.core.kv_view import KVView
    from server.kv_api import StreamEncoder, snapshot_payload

    llm = _llm(tiny_model_dir, tmp_path, caching=False)
    engine = llm.engine
    swap = engine.scheduler.kv_swap
    swap.min_tokens = 0
    view, encoder = KVView(engine.scheduler), StreamEncoder()
    encoder.encode(view.capture_now())
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, PARAMS)
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        snap = view.capture_now()
        body = json.loads(json.dumps(snapshot_payload(snap)))
        json.loads(encoder.encode(snap).split("data: ", 1)[1])  # the stream carries it too
        listed = {e["request_id"]: e for e in body["swapped_out"]}
        assert listed.keys() == swap.entries.keys()
        running = {r["request_id"] for r in body["requests"]}
        for rid, e in listed.items():
            assert rid not in running and e["num_blocks"] == len(swap.entries[rid].keys)
            seen.add((rid, e["state"]))
        c = body["counters"]
        assert c["num_swapped_out"] == len(listed)
        assert c["kv_swap_out_blocks_total"] == swap.out_blocks_total
        assert c["kv_swap_in_blocks_total"] == swap.in_blocks_total
        assert c["kv_swap_preemptions_total"] == swap.num_swapped_out_total
    assert {state for _, state in seen} >= {"out", "ready"}
    _assert_all_free(llm)
    engine.shutdown()


def test_store_pins_swap_entries_and_a_restart_deletes_them(tmp_path):
    from engine.core.kv_swap import SWAP_PREFIX

    fp, payload = bytes(range(32)), bytes(range(250)) * 4
    size = 1000 + 32 + 84  # a prefix file: payload, key, header
    store = DiskKVStore(tmp_path, 3 * size, fp)
    prefix = [bytes([i]) * 32 for i in range(3)]
    for key in prefix:
        store.put(key, payload)
    swapped = [SWAP_PREFIX + bytes([i]) * 32 for i in range(2)]
    assert store.swap_room(2 * len(payload)) and not store.swap_room(4 * len(payload))
    for key in swapped:
        store.put(key, payload)
    store.close()  # every write lands
    assert store.swap_bytes == 2 * len(payload)
    assert not any(store.contains(k) for k in swapped)  # never a prefix hit
    assert len(store) == 1  # the prefix files made way for the swap, the newest kept
    assert len(list(store.directory.glob("*.swap"))) == 2
    # Read once, then gone; a drop deletes the other's file (a restart deletes leftovers).
    store = DiskKVStore(tmp_path, 3 * size, fp)
    assert not list(store.directory.glob("*.swap")) and store.swap_bytes == 0
    store.put(swapped[0], payload)
    store.submit_load("mem", swapped[0])  # its write may still be queued: served from memory
    store.wait_for_load(5)
    assert store.poll_loads() == [("mem", payload)] and store.swap_bytes == 0
    store.put(swapped[1], payload)
    store.close()
    assert list(store.directory.glob("*.swap")) == [store._path(swapped[1])]


def test_two_swap_ins_never_hold_the_pool_between_them(tiny_model_dir, tmp_path):
    """Four 48-token prompts growing to 96 in an 8-block pool (16-token blocks), the default
    rule: two swapped-out requests once both loaded back and held every block (a deadlock);
    one swap-in at a time, loaded ones first, and each token is computed once."""
    prompts = make_prompts(4, min_len=48, max_len=48, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm = LLM(
        str(tiny_model_dir), dtype="float32", max_model_len=128, block_size=16,
        num_gpu_blocks_override=8, kv_offloading_size=0.01, kv_offloading_dir=str(tmp_path),
    )  # fmt: skip
    engine = llm.engine
    swap = engine.scheduler.kv_swap
    counted = _count_computed(llm)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done: dict[str, list[int]] = {}
    _step_until(engine, done, lambda: not engine.has_unfinished_requests(), max_s=120)
    assert [done[f"r{i}"] for i in range(4)] == hf_greedy(tiny_model_dir, prompts, 48)
    assert swap.num_swapped_out_total >= 2 and swap.num_recomputed_total == 0
    assert counted[0] == 4 * (48 + 47)
    _assert_all_free(llm)
    llm.engine.shutdown()
