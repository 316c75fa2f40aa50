"""Greedy tokens from the engine equal transformers' generate on the same tiny weights (float32)."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, make_prompts

from engine import LLM, SamplingParams

MAX_NEW = 20


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **kw)


def _run(model_dir, prompts, **engine_args):
    llm = LLM(str(model_dir), dtype="float32", **engine_args)
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def _assert_all_free(llm: LLM) -> None:
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    pool.check_integrity()
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not llm.engine.scheduler.kv_cache_manager.req_to_blocks


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(10, seed=1)


@pytest.fixture(scope="module")
def expected(tiny_model_dir, prompts):
    return hf_greedy(tiny_model_dir, prompts, MAX_NEW)


def test_batch_matches_transformers(tiny_model_dir, prompts, expected):
    llm, got = _run(tiny_model_dir, prompts)
    assert got == expected
    _assert_all_free(llm)


def test_tied_embeddings_gqa_matches_transformers(tiny_tied_model_dir):
    prompts = make_prompts(8, seed=2)
    llm, got = _run(tiny_tied_model_dir, prompts)
    assert got == hf_greedy(tiny_tied_model_dir, prompts, MAX_NEW)


def test_preemption_keeps_tokens(tiny_model_dir, prompts, expected):
    # 10 requests of up to 80 tokens need ~50 blocks of 16; 8 blocks force recompute preemption.
    llm, got = _run(tiny_model_dir, prompts, num_gpu_blocks_override=8, block_size=16)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert got == expected
    _assert_all_free(llm)


def test_preemption_without_prefix_caching(tiny_model_dir, prompts, expected):
    llm, got = _run(tiny_model_dir, prompts, num_gpu_blocks_override=8, enable_prefix_caching=False)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert got == expected
    _assert_all_free(llm)


@pytest.mark.parametrize("budget", [7, 32])
def test_chunked_prefill_keeps_tokens(tiny_model_dir, prompts, expected, budget):
    llm, got = _run(tiny_model_dir, prompts, max_num_batched_tokens=budget)
    assert got == expected
    _assert_all_free(llm)


def test_prefix_cache_hit_keeps_tokens(tiny_model_dir, prompts, expected):
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4)
    cold = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]
    warm_outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in warm_outs] == cold == expected
    assert sum(o.num_cached_tokens for o in warm_outs) > 0
    _assert_all_free(llm)


def test_eos_stops_generation(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32")
    prompt = make_prompts(1, seed=3)[0]
    free_run = llm.generate([prompt], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    # Declare the 5th greedy token as a stop token: generation must end right there.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[free_run[4]])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[: free_run.index(free_run[4]) + 1]
    assert out.finish_reason == "stop"
