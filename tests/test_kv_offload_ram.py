"""The second KV tier in host memory (engine/kv_offload/host_store.py), run on CPU through
--kv-offloading-backend cpu: prefix blocks evicted from a pool too small for the working set
come back as tier hits, greedy float32 output equals transformers', the store is an LRU within
its bound, loads run on the copy thread (the loop never waits), an abort while loading leaks
nothing, and the metrics report it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import count_prefill_tokens, hf_greedy, make_prompts, metric_value

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv_offload.disk_store import DiskKVStore
from engine.kv_offload.host_store import HostKVStore
from engine.kv_offload.setup import uses_host_memory

BS = 4
MAX_NEW = 6
NUM_BLOCKS = 24  # 96 tokens: one 40-token prompt fits, the four prompts' prefixes (~44) do not
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _llm(model_dir, **kw) -> LLM:
    kw.setdefault("kv_offloading_backend", "cpu")
    kw.setdefault("num_gpu_blocks_override", NUM_BLOCKS)
    return LLM(
        str(model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=32,
        block_size=BS, kv_offloading_size=0.01, **kw,
    )  # fmt: skip


def _one_by_one(llm: LLM, prompts) -> list[list[int]]:
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def _assert_all_free(llm: LLM) -> None:
    sched = llm.engine.scheduler
    kv = sched.kv_cache_manager
    kv.check_integrity()
    assert not sched.kv_tier.loading and not kv.req_to_blocks
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    assert llm.engine.kv_offload.store.num_inflight == 0


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(4, min_len=40, max_len=44, seed=3)


def test_ram_tier_hits_equal_transformers_and_leak_nothing(tiny_model_dir, prompts):
    ref = hf_greedy(tiny_model_dir, prompts, MAX_NEW)
    llm = _llm(tiny_model_dir)
    off = llm.engine.kv_offload
    assert isinstance(off.store, HostKVStore) and off.store.directory is None
    assert _one_by_one(llm, prompts) == ref  # fills the pool; earlier prefixes go to RAM
    assert off.store.bytes_stored_total > 0 and off.tier.hit_tokens_total == 0
    counted = count_prefill_tokens(llm)
    turns = [p + [5, 6, 7, 8, 9] for p in prompts]  # a second turn of each chat
    assert _one_by_one(llm, turns) == hf_greedy(tiny_model_dir, turns, MAX_NEW)
    assert off.tier.hit_tokens_total >= 3 * 40  # the evicted prefixes came back from RAM
    assert off.store.bytes_loaded_total > 0
    assert counted[0] < sum(map(len, turns)) / 2
    hits = off.tier.hit_tokens_total
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)  # all at once: more than the pool
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert off.tier.hit_tokens_total > hits
    _assert_all_free(llm)
    _check_metrics(llm)
    llm.engine.shutdown()
    assert len(off.store) == 0  # nothing persists


def _check_metrics(llm: LLM) -> None:
    from server.metrics import Metrics

    metrics = Metrics("m")
    metrics.watch_kv_memory(llm.engine)
    text = metrics.render().decode()
    off = llm.engine.kv_offload
    expect = {
        "vllm:external_prefix_cache_hits_total": off.tier.hit_tokens_total,
        "vllm:external_prefix_cache_queries_total": off.tier.queries_total,
        "vllm:kv_offload_store_bytes_total": off.store.bytes_stored_total,
        "vllm:kv_offload_load_bytes_total": off.store.bytes_loaded_total,
        "pagedserve:kv_tier_usage_bytes": len(off.store) * off.store.block_bytes,
        "pagedserve:kv_tier_capacity_bytes": int(0.01 * 2**30),
        "pagedserve:kv_tier_blocks": len(off.store),
        "pagedserve:kv_tier_corrupt_files_total": 0,
    }
    for name, value in expect.items():
        assert metric_value(text, name, {"model_name": "m"}) == value, name
    assert off.tier.hit_tokens_total > 0 and len(off.store) > 0


def test_backend_selection(tiny_model_dir, tmp_path):
    assert uses_host_memory("native", "cuda") and uses_host_memory(None, "cuda")
    assert uses_host_memory("cpu", "cpu") and uses_host_memory("cpu", "cuda")
    assert not uses_host_memory("native", "cpu") and not uses_host_memory(None, "cpu")
    assert not uses_host_memory("disk", "cuda")
    with pytest.raises(ValueError, match="native, disk or cpu"):
        EngineConfig(kv_offloading_size=1, kv_offloading_backend="ram")
    from engine.kv_offload.setup import attach_kv_offload

    cfg = EngineConfig(kv_offloading_size=1, kv_offloading_backend="cpu")
    with pytest.raises(ValueError, match="one process"):  # tensor parallel workers: disk only
        attach_kv_offload(SimpleNamespace(config=cfg, executor=SimpleNamespace()))
    llm = _llm(tiny_model_dir, kv_offloading_backend="native", kv_offloading_dir=str(tmp_path))
    assert isinstance(llm.engine.kv_offload.store, DiskKVStore)  # on CPU: today's disk tier
    llm.engine.shutdown()


def _fake_caches(num_blocks: int = 8):
    """Two layers' (K, V), each block's rows filled with its block id (and the tensor's)."""
    caches = []
    for layer in range(2):
        pair = tuple(torch.zeros(num_blocks, 2, 3) for _ in range(2))
        for i, t in enumerate(pair):
            t += torch.arange(num_blocks).view(-1, 1, 1) + 100 * (2 * layer + i)
        caches.append(pair)
    return caches


def _out(stores=(), loads=()):
    return SimpleNamespace(kv_stores=list(stores), kv_loads=list(loads), is_empty=True)


def _load(store: HostKVStore, block_id: int, key: bytes) -> None:
    store.step(_out(loads=[(block_id, key)]))
    deadline = time.monotonic() + 10
    while store.num_inflight and time.monotonic() < deadline:
        store.step(_out())


def test_store_is_a_bounded_lru(monkeypatch):
    caches = _fake_caches()
    one = HostKVStore(caches, 0).block_bytes
    assert one == 4 * 2 * 3 * 4
    store = HostKVStore(caches, 3 * one + one // 2)  # three blocks fit
    keys = [bytes([i]) * 32 for i in range(5)]
    store.step(_out(stores=[(i, keys[i]) for i in range(3)]))
    store.step(_out(stores=[(0, keys[0])]))  # touched: now the most recently used
    store.step(_out(stores=[(3, keys[3]), (4, keys[4])]))
    assert [store.contains(k) for k in keys] == [True, False, False, True, True]
    assert store.usage_bytes == 3 * one <= store.capacity_bytes and store._num_buffers == 3
    assert store.bytes_stored_total == 5 * one
    for t in (t for pair in caches for t in pair):
        t[6].zero_()
    _load(store, 6, keys[3])  # block 3's bytes into block 6, every tensor
    assert store.applied == [(6, True)] and store.bytes_loaded_total == one
    for pair in caches:
        for t in pair:
            assert torch.equal(t[6], t[3])
    # A buffer a load still reads is never reused: the LRU skips it.
    gate = threading.Event()
    real = HostKVStore.copy_in
    monkeypatch.setattr(HostKVStore, "copy_in", lambda s, b, buf: (gate.wait(10), real(s, b, buf)))
    store.step(_out(loads=[(7, keys[0])]))  # held back on the copy thread
    new = bytes([9]) * 32
    store.step(_out(stores=[(4, keys[4]), (3, keys[3]), (5, new)]))  # keys[0] is now the LRU
    assert [store.contains(k) for k in (keys[0], keys[3], keys[4], new)] == [1, 1, 0, 1]
    assert store.num_inflight == 1 and store._num_buffers == 3
    gate.set()
    _load(store, 7, keys[0])
    assert store.num_inflight == 0 and not store._reading
    for pair in caches:
        for t in pair:
            assert torch.equal(t[7], t[0])
    # One step that loads the LRU block and stores a new one: the store takes another buffer.
    assert list(store._index) == [keys[3], new, keys[0]]
    store.step(_out(stores=[(2, bytes([10]) * 32)], loads=[(6, keys[3])]))
    _load(store, 6, keys[3])
    assert store.applied[-2:] == [(6, True)] * 2 and store.contains(keys[3])
    assert not store.contains(new) and store.contains(bytes([10]) * 32)
    store.close()
    assert not store._thread.is_alive()


def test_loads_never_stall_the_loop_and_an_abort_leaks_nothing(
    tiny_model_dir, prompts, monkeypatch
):
    from test_kv_offload import _step_until

    long_prompt = prompts[1] + prompts[2]
    ref = hf_greedy(tiny_model_dir, [long_prompt], MAX_NEW)
    llm = _llm(tiny_model_dir, num_gpu_blocks_override=40)
    engine, tier = llm.engine, llm.engine.scheduler.kv_tier
    assert _one_by_one(llm, [long_prompt]) == ref
    engine.kv_offload.store.store_blocks(tier.cached_blocks())  # the pool's blocks into RAM
    assert engine.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
    gate = threading.Event()
    real = HostKVStore.copy_in
    monkeypatch.setattr(HostKVStore, "copy_in", lambda s, b, buf: (gate.wait(30), real(s, b, buf)))
    engine.add_request("tier", long_prompt, PARAMS)
    engine.add_request("other", prompts[3][:12], PARAMS)
    done: dict[str, list[int]] = {}
    slowest = _step_until(engine, done, lambda: "other" in done.get("finished", ()))
    assert "tier" in tier.loading and "tier" not in done  # its copies are held back
    assert done["other"] == hf_greedy(tiny_model_dir, [prompts[3][:12]], MAX_NEW)[0]
    assert slowest < 10.0  # a step that waited on the held-back disk would take 30 s
    gate.set()
    _step_until(engine, done, lambda: "tier" in done.get("finished", ()))
    assert [done["tier"]] == ref and tier.hit_tokens_total > 0
    _assert_all_free(llm)
    # An abort while its loads are held back: the blocks go once the copies land, never before.
    gate.clear()
    assert engine.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
    engine.add_request("gone", long_prompt, PARAMS)
    engine.step()
    assert "gone" in tier.loading
    engine.abort_request(["gone"])
    engine.step()
    held = engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert held < 40 and not engine.scheduler.waiting and not engine.scheduler.running
    gate.set()
    _step_until(engine, done, lambda: not tier.loading)
    _assert_all_free(llm)
    engine.shutdown()


def test_swap_entries_are_pinned_read_once_and_make_prefix_blocks_go():
    from engine.kv_offload.host_store import SWAP_PREFIX

    caches = _fake_caches()
    one = HostKVStore(caches, 0).block_bytes
    store = HostKVStore(caches, 3 * one)
    keys = [bytes([i]) * 32 for i in range(3)]
    swaps = [SWAP_PREFIX + bytes([i]) * 8 for i in range(3)]
    store.step(_out(stores=[(i, keys[i]) for i in range(3)]))
    assert store.swap_room(3 * one) and not store.swap_room(4 * one)
    store.step(_out(stores=[(3, swaps[0]), (4, swaps[1])]))  # two prefix blocks make way
    assert [store.contains(k) for k in keys] == [False, False, True]
    assert not store.contains(swaps[0]) and store.swap_bytes == 2 * one
    assert not store.swap_room(2 * one) and store.swap_room(one)
    store.step(_out(stores=[(5, keys[0])]))  # a prefix store never evicts a swap entry
    assert store.contains(keys[0]) and not store.contains(keys[2]) and store.swap_bytes == 2 * one
    for pair in caches:
        for t in pair:
            t[3].zero_()
    _load(store, 3, swaps[0])  # read once: the buffer is free again
    assert store.applied == [(3, True)] and store.swap_bytes == one
    for pair in caches:
        for t in pair:
            assert t[3].eq(t[4] - 1).all()  # block 3's old rows (each block: its id)
    store.drop_swap(swaps[1])  # its blocks were still in the pool
    assert store.swap_bytes == 0 and len(store._free) == 2 and store._num_buffers == 3
    store.step(_out(stores=[(6, keys[1]), (7, keys[2])]))  # the free buffers, nothing evicted
    assert [store.contains(k) for k in keys] == [True, True, True]
    _load(store, 0, swaps[1])  # dropped: a failed load, recomputed by the scheduler
    assert store.applied[-1] == (0, False)
    store.close()


def test_swap_preemption_through_the_ram_tier(tiny_model_dir):
    """Runs once swap preemption (engine/core/kv_swap.py, branch i45s) is on the same tree."""
    pytest.importorskip("engine.core.kv_swap")
    prompts = make_prompts(4, min_len=20, max_len=24, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = _llm(tiny_model_dir, num_gpu_blocks_override=20)
    swap = llm.engine.scheduler.kv_swap
    swap.min_tokens = 0  # every preemption swaps
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_model_dir, prompts, 24)
    assert swap.num_swapped_out_total > 0 and swap.in_blocks_total > 0
    assert llm.engine.kv_offload.store.swap_bytes == 0
    _assert_all_free(llm)
    llm.engine.shutdown()
