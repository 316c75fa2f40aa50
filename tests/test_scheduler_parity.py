"""The scheduler through the real engine (float32): chunking and preemption never change tokens."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, make_prompts

from engine import LLM, SamplingParams
from engine.core.kv_cache_manager import cdiv

MAX_NEW = 16
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(16, seed=3, min_len=3, max_len=40)


@pytest.fixture(scope="module")
def expected(tiny_model_dir, prompts) -> list[list[int]]:
    return hf_greedy(tiny_model_dir, prompts, MAX_NEW)


def _generate(model_dir, prompts, **engine_args):
    """Drives LLMEngine.step() directly, keeping every step's StepStats."""
    engine = LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE, **engine_args).engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    all_stats = []
    while engine.has_unfinished_requests():
        assert len(all_stats) < 5000, "engine did not drain"
        outputs, stats = engine.step()
        all_stats.append(stats)
        for out in outputs:
            tokens[out.request_id] += out.outputs[0].token_ids
    return engine, [tokens[str(i)] for i in range(len(prompts))], all_stats


def _assert_all_free(engine) -> None:
    kv = engine.scheduler.kv_cache_manager
    kv.block_pool.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    assert not kv.req_to_blocks and not engine.scheduler.requests


def _assert_request_stats(all_stats, num_requests: int) -> None:
    finished = [m for s in all_stats for m in s.finished]
    assert len(finished) == num_requests
    for m in finished:
        assert 0 <= m.queue_time <= m.time_to_first_token <= m.e2e_latency
    assert sum(s.num_generation_tokens for s in all_stats) == num_requests * MAX_NEW


@pytest.mark.parametrize("budget", [5, 13, 24])
def test_chunked_prefill_matches_transformers(tiny_model_dir, prompts, expected, budget):
    assert budget < max(len(p) for p in prompts)  # at least one prompt is chunked
    engine, got, all_stats = _generate(tiny_model_dir, prompts, max_num_batched_tokens=budget)
    assert got == expected
    assert all(0 < s.num_scheduled_tokens <= budget for s in all_stats)
    assert all(s.num_running <= engine.config.max_num_seqs for s in all_stats)
    _assert_request_stats(all_stats, len(prompts))
    _assert_all_free(engine)


@pytest.mark.parametrize(
    "caching,budget", [(True, 2048), (False, 2048), (True, 7)], ids=["cache", "nocache", "chunked"]
)
def test_heavy_preemption_matches_transformers(tiny_model_dir, prompts, expected, caching, budget):
    needs = [cdiv(len(p) + MAX_NEW - 1, BLOCK_SIZE) for p in prompts]
    num_blocks = max(sum(needs) // 10, max(needs))  # a tenth of the workload's need
    assert num_blocks * 8 < sum(needs)
    engine, got, all_stats = _generate(
        tiny_model_dir,
        prompts,
        num_gpu_blocks_override=num_blocks,
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
    )
    assert got == expected
    num_preemptions = engine.scheduler.num_preemptions_total
    assert num_preemptions > len(prompts) // 2
    assert sum(s.num_preemptions for s in all_stats) == num_preemptions
    _assert_request_stats(all_stats, len(prompts))
    _assert_all_free(engine)
