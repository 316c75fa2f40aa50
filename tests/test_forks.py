"""n > 1 as copy-on-write forks, end to end: the prompt is prefilled once, every sample's tokens
equal transformers' greedy generate (float32) under chunked prefill, prefix hits, preemption
and a sliding window; seeded samples are reproducible and equal the independent-children path;
block copies really move KV (CPU torch)."""

from __future__ import annotations

import pytest
import torch
from conftest import count_prefill_tokens, hf_greedy, make_prompts
from test_gemma import build_windowed_dir, window_prompts

from engine import LLM, SamplingParams
from engine.runner.block_copy import copy_blocks

BS = 4
MAX_NEW = 10


def _llm(path, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 8)  # chunked prefill: a 30-token prompt in 4 chunks
    return LLM(str(path), dtype="float32", block_size=BS, max_model_len=256, **kw)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **kw)


def _samples(llm: LLM, prompts, params: SamplingParams) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished and len(o.outputs) == params.n for o in outs)
    assert all([c.index for c in o.outputs] == list(range(params.n)) for o in outs)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _assert_all_free(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    assert not kv.req_to_blocks and not kv.cow_requests and not kv.fork_members
    assert not llm.engine.scheduler.fork_waiting


@pytest.mark.parametrize("prompt_len", [30, 32])  # a partly filled last block, and a full one
def test_greedy_forks_equal_transformers_and_prefill_once(tiny_model_dir, prompt_len):
    (prompt,) = make_prompts(1, seed=45, min_len=prompt_len, max_len=prompt_len)
    (expected,) = hf_greedy(tiny_model_dir, [prompt], MAX_NEW)
    llm = _llm(tiny_model_dir, enable_prefix_caching=False)  # no help from the prefix cache
    prefilled = count_prefill_tokens(llm)
    ((a, b, c),) = _samples(llm, [prompt], _greedy(3))
    assert a == b == c == expected
    # the prompt once, plus one recomputed last token per forked child
    assert prefilled[0] == prompt_len + 2
    sched = llm.engine.scheduler
    assert sched.num_forks_total == 2
    # each child's and the parent's first write copied the shared last block (partial case);
    # with a full last block only the two children recompute into it
    assert sched.kv_cache_manager.num_cow_copies_total == 2
    _assert_all_free(llm)


def test_independent_children_path_stays_selectable(tiny_model_dir):
    (prompt,) = make_prompts(1, seed=46, min_len=30, max_len=30)
    (expected,) = hf_greedy(tiny_model_dir, [prompt], MAX_NEW)
    llm = _llm(tiny_model_dir, fork_parallel_samples=False)
    ((a, b),) = _samples(llm, [prompt], _greedy(2))
    assert a == b == expected
    assert llm.engine.scheduler.num_forks_total == 0
    _assert_all_free(llm)


def test_forks_beside_other_requests_with_prefix_hits_and_preemption(tiny_model_dir):
    prompts = make_prompts(4, seed=47, min_len=20, max_len=40)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_NEW)
    # 40 blocks of 4 tokens: 4 prompts x 3 samples do not fit at once, so children and parents
    # are preempted and resume through prefix hits on their siblings' blocks.
    llm = _llm(tiny_model_dir, num_gpu_blocks_override=40)
    for _ in range(2):  # the second round starts with prefix hits on the first round's blocks
        got = _samples(llm, prompts, _greedy(3))
        assert got == [[e] * 3 for e in expected]
        _assert_all_free(llm)
    sched = llm.engine.scheduler
    assert sched.num_forks_total > 0 and sched.num_preemptions_total > 0


def test_seeded_samples_reproducible_and_equal_to_independent_children(tiny_model_dir):
    (prompt,) = make_prompts(1, seed=48, min_len=30, max_len=30)
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=MAX_NEW, ignore_eos=True)
    forked = _samples(_llm(tiny_model_dir), [prompt], params)
    again = _samples(_llm(tiny_model_dir), [prompt], params)
    independent = _samples(_llm(tiny_model_dir, fork_parallel_samples=False), [prompt], params)
    assert forked == again == independent
    assert len({tuple(s) for s in forked[0]}) > 1  # seed + i: the samples differ


def test_sliding_window_forks_equal_transformers(tmp_path):
    path = build_windowed_dir(tmp_path / "gemma3", "gemma3")
    prompts = window_prompts()
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm = _llm(path)
    assert llm.engine.scheduler.kv_cache_manager.is_hybrid
    got = _samples(llm, prompts, _greedy(2))
    assert got == [[e, e] for e in expected]
    assert llm.engine.scheduler.num_forks_total == len(prompts)
    _assert_all_free(llm)


def test_copy_blocks_moves_every_kv_tensor_once_reading_before_writing():
    shared = (torch.arange(24.0).view(6, 2, 1, 2), torch.arange(24.0).view(6, 2, 1, 2) + 100)
    other = (torch.zeros(6, 2, 1, 2), torch.ones(6, 2, 1, 2))
    before = [t.clone() for t in (*shared, *other)]
    # block 1 -> 4, and block 4's old content -> 1 in the same step (read before write)
    copy_blocks([shared, shared, other], [(1, 4), (4, 1)])
    for t, old in zip((*shared, *other), before):
        assert torch.equal(t[4], old[1]) and torch.equal(t[1], old[4])
        assert torch.equal(t[[0, 2, 3, 5]], old[[0, 2, 3, 5]])


def test_forks_with_ngram_speculation_equal_transformers(tiny_model_dir):
    """Forked samples under n-gram speculation: drafts' slots past the copied block, rejected
    drafts' blocks given back, the same greedy tokens."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats: the n-gram proposer drafts
    (expected,) = hf_greedy(tiny_model_dir, [prompt], MAX_NEW)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 2}  # fmt: skip
    llm = _llm(tiny_model_dir, speculative_config=spec)
    ((a, b, c),) = _samples(llm, [prompt], _greedy(3))
    assert a == b == c == expected
    assert llm.engine.scheduler.num_forks_total == 2
    assert llm.engine.spec_decode_totals.num_drafts > 0
    _assert_all_free(llm)
