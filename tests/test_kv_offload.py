"""The second KV tier (engine/kv_offload/, engine/core/kv_tier.py): prefix blocks evicted from a
pool too small for the working set go to disk and come back as tier hits; greedy float32 output
equals transformers'; the files persist across restarts, keyed by model and layout, checksummed;
the step loop never waits on the disk; no block leaks."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    build_tiny_model_dir,
    count_prefill_tokens,
    hf_greedy,
    make_prompts,
    metric_value,
)

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv_offload.disk_store import DiskKVStore
from engine.kv_offload.setup import attach_kv_offload

BS = 4
MAX_NEW = 6
NUM_BLOCKS = 24  # 96 tokens: one 40-token prompt fits, the four prompts' prefixes (~44) do not
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _llm(model_dir, tier_dir, **kw) -> LLM:
    kw.setdefault("block_size", BS)
    kw.setdefault("num_gpu_blocks_override", NUM_BLOCKS)
    return LLM(
        str(model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=32,
        kv_offloading_size=0.01, kv_offloading_dir=str(tier_dir), **kw,
    )  # fmt: skip


def _one_by_one(llm: LLM, prompts) -> list[list[int]]:
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def _assert_all_free(llm: LLM) -> None:
    sched = llm.engine.scheduler
    kv = sched.kv_cache_manager
    kv.check_integrity()
    assert not sched.kv_tier.loading and not kv.req_to_blocks
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(4, min_len=40, max_len=44, seed=3)


def test_tier_hits_equal_transformers_and_leak_nothing(tiny_model_dir, tmp_path, prompts):
    ref = hf_greedy(tiny_model_dir, prompts, MAX_NEW)
    llm = _llm(tiny_model_dir, tmp_path)
    off = llm.engine.kv_offload
    assert _one_by_one(llm, prompts) == ref  # fills the pool; earlier prefixes go to disk
    assert off.store.bytes_stored_total > 0 and off.tier.hit_tokens_total == 0
    counted = count_prefill_tokens(llm)
    # Second turn: each prompt again with new tokens (a multi-turn chat), then all at once.
    turns = [p + [5, 6, 7, 8, 9] for p in prompts]
    assert _one_by_one(llm, turns) == hf_greedy(tiny_model_dir, turns, MAX_NEW)
    assert off.tier.hit_tokens_total >= 3 * 40  # the evicted prefixes came back from disk
    assert off.store.bytes_loaded_total > 0
    assert counted[0] < sum(map(len, turns)) / 2
    # All at once: the pool cannot hold them all, and their prefixes come back from the tier.
    # Whether a request is also preempted depends on when its loads land (the copy thread), so
    # it is not asserted here (tests/test_kv_offload_tp.py has the deterministic one).
    hits = off.tier.hit_tokens_total
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert off.tier.hit_tokens_total > hits
    _assert_all_free(llm)
    _check_metrics(llm)
    llm.engine.shutdown()


def _check_metrics(llm: LLM) -> None:
    from server.metrics import Metrics

    metrics = Metrics("m")
    metrics.watch_kv_memory(llm.engine)
    text = metrics.render().decode()
    off = llm.engine.kv_offload
    expect = {
        "vllm:external_prefix_cache_hits_total": off.tier.hit_tokens_total,
        "vllm:kv_offload_store_bytes_total": off.store.bytes_stored_total,
        "vllm:kv_offload_load_bytes_total": off.store.bytes_loaded_total,
        "pagedserve:kv_tier_usage_bytes": off.store.usage_bytes,
        "pagedserve:kv_tier_blocks": len(off.store),
        "pagedserve:forks_total": 0,
        "pagedserve:kv_cow_copies_total": 0,
    }
    for name, value in expect.items():
        assert metric_value(text, name, {"model_name": "m"}) == value, name
    assert off.tier.hit_tokens_total > 0 and off.store.usage_bytes > 0


def test_flags_are_checked():
    with pytest.raises(ValueError, match="LMCache's wheels need CUDA"):
        EngineConfig(kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="need kv_offloading_size"):
        EngineConfig(kv_offloading_backend="native")
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(kv_offloading_size=0)


def test_restart_serves_repeated_prompt_from_tier(tiny_model_dir, tmp_path, prompts):
    long_prompt = prompts[0] + prompts[1]  # 80+ tokens
    ref = hf_greedy(tiny_model_dir, [long_prompt], MAX_NEW)
    first = _llm(tiny_model_dir, tmp_path)
    cold = count_prefill_tokens(first)
    assert _one_by_one(first, [long_prompt]) == ref
    first.engine.shutdown()  # flushes the pool's cached blocks to the tier
    assert cold[0] == len(long_prompt)
    second = _llm(tiny_model_dir, tmp_path)
    warm = count_prefill_tokens(second)
    kv = second.engine.scheduler.kv_cache_manager
    kv.enable_kv_events()
    assert _one_by_one(second, [long_prompt]) == ref
    stored = [e for e in kv.take_kv_events() if e[0] == "stored"]
    # Loaded blocks are announced as stored, with their tokens (engine/core/kv_event_log.py).
    assert stored and all(len(e) == 6 for e in stored)
    assert stored[0][4] == long_prompt[: len(stored[0][2]) * BS]
    assert second.engine.kv_offload.tier.hit_tokens_total >= len(long_prompt) - BS - 1
    assert warm[0] <= BS  # only the last partial block (and the token for logits) computed
    _assert_all_free(second)
    second.engine.shutdown()


def _tier_files(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("*/*.kv"))


def test_corrupt_and_truncated_files_are_skipped(tiny_model_dir, tmp_path, prompts, caplog):
    long_prompt = prompts[2] + prompts[3]
    ref = hf_greedy(tiny_model_dir, [long_prompt], MAX_NEW)
    first = _llm(tiny_model_dir, tmp_path)
    assert _one_by_one(first, [long_prompt]) == ref
    first.engine.shutdown()
    files = _tier_files(tmp_path)
    assert len(files) >= 10
    for path in files[::3]:  # a flipped payload byte
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    for path in files[1::3]:  # a torn write
        path.write_bytes(path.read_bytes()[:-100])
    second = _llm(tiny_model_dir, tmp_path)
    with caplog.at_level(logging.WARNING, logger="engine.kv_offload.disk_store"):
        assert _one_by_one(second, [long_prompt]) == ref
    lines = [r.getMessage() for r in caplog.records if "KV tier: skipping" in r.getMessage()]
    assert any("checksum mismatch" in m for m in lines) or any("truncated" in m for m in lines)
    assert second.engine.kv_offload.store.num_corrupt_total >= 1
    assert second.engine.kv_offload.tier.num_failed_loads_total >= 1
    _assert_all_free(second)
    second.engine.shutdown()


def test_another_model_or_block_size_never_reuses_the_files(tmp_path, prompts, caplog):
    a = build_tiny_model_dir(tmp_path / "a", seed=5)
    b = build_tiny_model_dir(tmp_path / "b", seed=6)  # same config, other weights
    tier = tmp_path / "tier"
    long_prompt = prompts[0] + prompts[3]
    first = _llm(a, tier)
    assert _one_by_one(first, [long_prompt]) == hf_greedy(a, [long_prompt], MAX_NEW)
    first.engine.shutdown()
    a_dir = first.engine.kv_offload.store.directory
    dirs = []
    for model_dir, kw in ((b, {}), (a, {"block_size": 8, "num_gpu_blocks_override": 12})):
        other = _llm(model_dir, tier, **kw)
        store = other.engine.kv_offload.store
        assert store.directory != a_dir and len(store) == 0
        assert _one_by_one(other, [long_prompt]) == hf_greedy(model_dir, [long_prompt], MAX_NEW)
        assert other.engine.kv_offload.tier.hit_tokens_total == 0
        other.engine.shutdown()
        dirs.append(store.directory)
    # A's files copied over B's (a renamed or shared folder): the header tells them apart.
    for path in a_dir.glob("*.kv"):
        (dirs[0] / path.name).write_bytes(path.read_bytes())
    other = _llm(b, tier)
    with caplog.at_level(logging.WARNING, logger="engine.kv_offload.disk_store"):
        assert _one_by_one(other, [long_prompt]) == hf_greedy(b, [long_prompt], MAX_NEW)
    assert any("another model" in r.getMessage() for r in caplog.records)
    _assert_all_free(other)
    other.engine.shutdown()


class GatedDisk(DiskKVStore):
    """A disk whose reads hang until the test opens the gate, and whose writes are slow."""

    gate = threading.Event()

    def write_file(self, path, data):
        time.sleep(0.2)
        super().write_file(path, data)

    def read_file(self, path):
        assert self.gate.wait(30)
        return super().read_file(path)


def _step_until(engine, done: dict, until, max_s: float = 60.0) -> float:
    """Steps until until() holds; returns the slowest step's seconds."""
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


def test_a_slow_disk_never_stalls_the_step_loop(tiny_model_dir, tmp_path, prompts):
    long_prompt = prompts[1] + prompts[2]
    first = _llm(tiny_model_dir, tmp_path)
    ref = _one_by_one(first, [long_prompt])
    first.engine.shutdown()
    llm = LLM(
        str(tiny_model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=32,
        block_size=BS, num_gpu_blocks_override=40,
    )  # fmt: skip
    engine = llm.engine
    object.__setattr__(engine.config, "kv_offloading_size", 0.01)
    object.__setattr__(engine.config, "kv_offloading_dir", str(tmp_path))
    engine.kv_offload = attach_kv_offload(engine, store_cls=GatedDisk)
    tier = engine.scheduler.kv_tier
    GatedDisk.gate.clear()
    engine.add_request("tier", long_prompt, PARAMS)
    engine.add_request("other", prompts[3][:12], PARAMS)
    done: dict[str, list[int]] = {}
    slowest = _step_until(engine, done, lambda: "other" in done.get("finished", ()))
    assert "tier" in tier.loading and "tier" not in done  # its loads hang on the disk
    assert done["other"] == hf_greedy(tiny_model_dir, [prompts[3][:12]], MAX_NEW)[0]
    assert slowest < 10.0  # a step that waited on the held-back disk would take 30 s
    GatedDisk.gate.set()
    _step_until(engine, done, lambda: "tier" in done.get("finished", ()))
    assert [done["tier"]] == ref and tier.hit_tokens_total > 0
    _assert_all_free(llm)
    # An abort while its loads hang: the blocks go once the loads land, never before.
    GatedDisk.gate.clear()
    assert engine.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
    engine.add_request("gone", long_prompt, PARAMS)
    engine.step()
    assert "gone" in tier.loading
    engine.abort_request(["gone"])
    engine.step()
    held = engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert held < 40 and not engine.scheduler.waiting and not engine.scheduler.running
    GatedDisk.gate.set()
    _step_until(engine, done, lambda: not tier.loading)
    _assert_all_free(llm)
    engine.shutdown()


def test_store_is_bounded_lru_and_survives_reopen(tmp_path):
    fp = bytes(range(32))
    payload = bytes(1000)
    size = 1000 + 32 + 84  # payload, key, header
    store = DiskKVStore(tmp_path, 3 * size, fp)
    keys = [bytes([i]) * 32 for i in range(5)]
    for key in keys[:3]:
        store.put(key, payload)
    store.close()
    store = DiskKVStore(tmp_path, 3 * size, fp)
    assert [store.contains(k) for k in keys[:3]] == [True] * 3
    store.put(keys[0], payload)  # touched: now the most recently used
    store.put(keys[3], payload)
    store.put(keys[4], payload)
    store.close()
    assert [store.contains(k) for k in keys] == [True, False, False, True, True]
    assert store.usage_bytes == 3 * size == sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    store = DiskKVStore(tmp_path, 2 * size, fp)  # restarted with a smaller bound
    assert len(store) == 2 and not store.contains(keys[0])
    store.submit_load("t", keys[4])
    store.wait_for_load(5)
    assert store.poll_loads() == [("t", payload)]
    store.close()
