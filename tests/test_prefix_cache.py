"""Prefix caching through the engine: hits reuse KV without changing a single greedy token."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import hf_greedy, make_prompts, metric_value

from engine import LLM, SamplingParams
from server.metrics import metric_name

BS = 4
MAX_NEW = 12


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks
    assert not kv.req_to_blocks and not kv.req_to_block_hashes


@pytest.fixture(scope="module")
def base() -> list[int]:
    return make_prompts(1, seed=11, min_len=32, max_len=32)[0]  # exactly 8 blocks


def test_cold_warm_and_evicted_runs_give_the_same_tokens(tiny_model_dir, base):
    prompt = base[:30]  # 7 full blocks + a partial one
    (expected,) = hf_greedy(tiny_model_dir, [prompt], MAX_NEW)
    # 16 blocks of 4 = 64 tokens: the unrelated batch below must evict the cached prompt.
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=BS, num_gpu_blocks_override=16)
    (cold,), (cold_hit,) = _generate(llm, [prompt])
    (warm,), (warm_hit,) = _generate(llm, [prompt])
    assert cold_hit == 0 and warm_hit == 28  # every full block of the prompt
    unrelated = make_prompts(4, seed=12, min_len=40, max_len=50)
    _generate(llm, unrelated)
    kv = llm.engine.scheduler.kv_cache_manager
    assert all(kv.block_pool.get_cached_block(h) is None for h in _prompt_hashes(kv, prompt))
    (evicted,), (evicted_hit,) = _generate(llm, [prompt])
    assert evicted_hit == 0
    assert cold == warm == evicted == expected
    _assert_no_leak(llm)


def _prompt_hashes(kv, prompt: list[int]) -> list[bytes]:
    from engine.core.kv_cache_manager import hash_block_tokens

    hashes, parent = [], None
    for start in range(0, len(prompt) - BS + 1, BS):
        parent = hash_block_tokens(parent, prompt[start : start + BS])
        hashes.append(parent)
    return hashes


def test_hits_at_a_block_boundary_and_mid_block_recompute_correctly(tiny_model_dir, base):
    variants = make_prompts(2, seed=13, vocab_lo=3, vocab_hi=259, min_len=10, max_len=10)
    prompts = [
        base,  # first run: caches 8 full blocks
        base,  # same prompt, a multiple of the block size: the cap recomputes the last block
        base + variants[0][:8],  # extends at exactly a block boundary: all 8 blocks hit
        base[:26] + variants[1],  # diverges mid-block: the hit stops at 24, 2 shared recomputed
    ]
    expected = hf_greedy(tiny_model_dir, prompts, MAX_NEW)
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=BS)
    hits = []
    for prompt, want in zip(prompts, expected):
        (got,), (hit,) = _generate(llm, [prompt])  # one at a time, so each sees the last cached
        assert got == want
        hits.append(hit)
    assert hits == [0, 28, 32, 24]
    _assert_no_leak(llm)


def test_blocks_written_during_decode_are_hit_too(tiny_model_dir, base):
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=BS)
    (first,), _ = _generate(llm, [base])
    follow_up = base + first  # 44 tokens; the last sampled token never had its KV written
    (got,), (hit,) = _generate(llm, [follow_up])
    assert hit == 40  # 10 full blocks, two of them filled by decode steps
    assert got == hf_greedy(tiny_model_dir, [follow_up], MAX_NEW)[0]
    _assert_no_leak(llm)


def test_requests_with_a_shared_system_prompt_share_blocks(tiny_model_dir, base):
    suffixes = make_prompts(2, seed=14, min_len=6, max_len=6)
    prompts = [base + suffixes[0], base + suffixes[1], base + suffixes[0]]  # the last as n=2
    expected = hf_greedy(tiny_model_dir, prompts, MAX_NEW)
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=BS)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, _greedy())
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    cached: dict[str, int] = {}
    kv = engine.scheduler.kv_cache_manager
    shared_seen = False
    while engine.has_unfinished_requests():
        if len(kv.req_to_blocks) == 3:  # all three hold blocks: the prefix is one set of blocks
            tables = [kv.req_to_blocks[f"r{i}"] for i in range(3)]
            assert tables[0][:8] == tables[1][:8] == tables[2][:8]
            assert all(b.ref_cnt == 3 for b in tables[0][:8])
            assert tables[0][8] is tables[2][8] and tables[0][8].ref_cnt == 2  # same 9th block
            assert tables[1][8].ref_cnt == 1  # its own suffix
            kv.check_integrity()
            shared_seen = True
        step_outputs, _ = engine.step()
        for out in step_outputs:
            outputs[out.request_id] += out.outputs[0].token_ids
            cached[out.request_id] = out.num_cached_tokens
    assert shared_seen
    assert [outputs[f"r{i}"] for i in range(3)] == expected
    assert cached == {"r0": 0, "r1": 32, "r2": 36}  # r2's 38 tokens: 9 full blocks, cap 37
    _assert_no_leak(llm)


def test_prefix_caching_off_computes_everything(tiny_model_dir, base):
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=BS, enable_prefix_caching=False)
    (a,), (hit_a,) = _generate(llm, [base])
    (b,), (hit_b,) = _generate(llm, [base])
    assert a == b and hit_a == hit_b == 0
    assert not llm.engine.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    _assert_no_leak(llm)


def _wait_for_metrics(url: str, ready, timeout: float = 30.0) -> str:
    """Stats are observed right after the outputs are dispatched: poll, with a generous bound."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        if ready(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def test_server_metrics_count_prefix_hits_and_go_idle(tiny_server):
    def read(text: str, name: str) -> float:
        return metric_value(text, metric_name(name))

    idle = lambda text: read(text, "kv_cache_usage_perc") == 0.0  # noqa: E731
    before = _wait_for_metrics(tiny_server.url, idle)
    prompt = "a shared system prompt, long enough to fill several blocks of sixteen! " * 2
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    for _ in range(2):
        r = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    num_prompt = r.json()["usage"]["prompt_tokens"]
    after = _wait_for_metrics(tiny_server.url, idle)
    queries = read(after, "prefix_cache_queries_total") - read(before, "prefix_cache_queries_total")
    hits = read(after, "prefix_cache_hits_total") - read(before, "prefix_cache_hits_total")
    assert queries == 2 * num_prompt  # each request looked up once, when admitted
    assert hits >= (num_prompt - 1) // 16 * 16 > 0  # the repeat hit every full block
    assert read(after, "kv_cache_usage_perc") == 0.0
    total = read(after, "kv_cache_total_blocks")
    assert read(after, "kv_cache_free_blocks") == total and read(after, "kv_cache_used_blocks") == 0
    assert read(after, "kv_cache_cached_blocks") >= num_prompt // 16
