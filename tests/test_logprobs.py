"""Logprobs of sampled and prompt tokens equal log_softmax of transformers' logits (float32)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_prompts

from engine import LLM, SamplingParams

ATOL = 1e-3
MAX_NEW = 8


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check_entry(entry, ref: torch.Tensor, token_id: int, k: int) -> None:
    """One TokenLogprobs against a reference log-distribution row."""
    assert entry.token_id == token_id
    assert entry.logprob == pytest.approx(ref[token_id].item(), abs=ATOL)
    assert entry.rank == int((ref > ref[token_id]).sum()) + 1
    assert len(entry.top) == k
    ref_top = ref.topk(k)
    assert [t for t, _ in entry.top] == ref_top.indices.tolist()
    assert [lp for _, lp in entry.top] == pytest.approx(ref_top.values.tolist(), abs=ATOL)
    assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:]))  # best first


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", block_size=4)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_sampled_logprobs_match_transformers(llm, hf_model, temperature):
    prompts = make_prompts(3, seed=41)
    params = SamplingParams(
        temperature=temperature, seed=3, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5
    )
    ranks = []
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == MAX_NEW
        ref = _hf_logprobs(hf_model, prompt + c.token_ids)[len(prompt) - 1 : -1]  # [MAX_NEW, V]
        for j, (entry, tok) in enumerate(zip(c.logprobs, c.token_ids)):
            _check_entry(entry, ref[j], tok, 5)  # raw distribution: no temperature in it
            ranks.append(entry.rank)
    if temperature == 0.0:
        assert set(ranks) == {1}
    else:
        assert max(ranks) > 1  # sampled tokens that were not the most likely keep their rank


def test_logprobs_zero_gives_only_the_sampled_token(llm, hf_model):
    prompt = make_prompts(1, seed=42)[0]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
    c = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ref = _hf_logprobs(hf_model, prompt + c.token_ids)[len(prompt) - 1 : -1]
    for j, entry in enumerate(c.logprobs):
        _check_entry(entry, ref[j], c.token_ids[j], 0)


def test_no_logprobs_unless_asked(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.outputs[0].logprobs is None and out.prompt_logprobs is None


def _check_prompt_logprobs(outs, prompts, hf_model, k: int) -> None:
    for prompt, out in zip(prompts, outs):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        ref = _hf_logprobs(hf_model, prompt)
        for p in range(1, len(prompt)):
            _check_entry(plp[p], ref[p - 1], prompt[p], k)


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 7},  # prompts arrive in chunks of up to 7 rows
        {"num_gpu_blocks_override": 8, "block_size": 16},  # recompute preemption
    ],
    ids=["whole", "chunked", "preempted"],
)
def test_prompt_logprobs_match_transformers(tiny_model_dir, hf_model, engine_args):
    llm = LLM(str(tiny_model_dir), dtype="float32", **engine_args)
    prompts = make_prompts(6, seed=43, min_len=20, max_len=45)
    params = SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=3, logprobs=2
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.scheduler.num_preemptions_total > 0
    _check_prompt_logprobs(outs, prompts, hf_model, 3)
    for out in outs:
        assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids) == 20


def test_prompt_logprobs_despite_cached_prefix(llm, hf_model):
    """A warm prefix cache would skip prompt rows: requests with prompt_logprobs recompute."""
    prompts = make_prompts(2, seed=44, min_len=30, max_len=40)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in llm.generate(prompts, warm, use_tqdm=False)) > 0
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    _check_prompt_logprobs(outs, prompts, hf_model, 1)
    # Plain requests still hit the cache afterwards (the skip is per request).
    assert sum(o.num_cached_tokens for o in llm.generate(prompts, warm, use_tqdm=False)) > 0


def test_prompt_logprobs_arrive_once_on_the_first_delta(tiny_model_dir):
    from conftest import run_engine

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    prompt = make_prompts(1, seed=45)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    outs = run_engine(engine, {"a": (prompt, params), "b": ([3, 4], params)})
    for rid, p in (("a", prompt), ("b", [3, 4])):
        assert len(outs[rid][0].prompt_logprobs) == len(p)
        assert all(o.prompt_logprobs is None for o in outs[rid][1:])
        assert outs[rid][0].prompt_logprobs[1].top == []
