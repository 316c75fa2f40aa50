"""Sliding-window models against transformers: tiny random-weight Gemma 2, Gemma 3, windowed
Mistral and Qwen2 built in-process, greedy tokens equal generate's in float32 alone, batched,
with chunked prefill, prefix-cache hits and preemption, on prompts shorter than, equal to and
longer than the window, decoding across the window; sliding groups really return blocks."""

from __future__ import annotations

import pytest
from conftest import build_byte_tokenizer, hf_greedy

from engine import LLM, SamplingParams

WINDOW = 8
BLOCK = 4
MAX_NEW = 14  # a 3-token prompt decodes well past the window
NORM_STD = 3.0  # random (1 + w) norm scales: the residual stream stops echoing the last token
# family -> (config class, model class, overrides)
MODELS = {
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        # low caps so soft-capping changes scores (and the argmax when it is wrong)
        {"query_pre_attn_scalar": 16, "attn_logit_softcapping": 5.0,
         "final_logit_softcapping": 3.0},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        # layers 2 and 5 global, with linear rope scaling there (local layers keep 10k)
        {"query_pre_attn_scalar": 16, "num_hidden_layers": 6, "sliding_window_pattern": 3,
         "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False}),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "max_window_layers": 2, "tie_word_embeddings": False},
    ),
}


def build_windowed_dir(path, family: str, seed: int = 0, **extra):
    import torch
    import transformers

    cfg_name, model_name, overrides = MODELS[family]
    tokenizer = build_byte_tokenizer()
    cfg = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rms_norm_eps=1e-5, initializer_range=0.3, sliding_window=WINDOW,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cfg.update(overrides)
    cfg.update(extra)
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**cfg)
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, NORM_STD)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def window_prompts() -> list[list[int]]:
    """Shorter than, equal to, one past and several windows longer than the window."""
    import random

    rng = random.Random(7)
    lengths = [3, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW, 3 * WINDOW + 5]
    return [[rng.randrange(3, 259) for _ in range(n)] for n in lengths]


def _greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(llm: LLM, prompts, max_tokens: int = MAX_NEW) -> list[list[int]]:
    outs = llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BLOCK, max_model_len=256, **kw)


def _assert_all_free(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks


@pytest.fixture(scope="module", params=list(MODELS))
def family(request, tmp_path_factory):
    """(name, folder, prompts, transformers' greedy tokens) per family, built once."""
    path = build_windowed_dir(tmp_path_factory.mktemp(request.param), request.param)
    prompts = window_prompts()
    return request.param, path, prompts, hf_greedy(path, prompts, MAX_NEW)


def test_layout_groups_the_windowed_layers(family):
    name, path, _, _ = family
    spec = _llm(path).engine.runner.kv_cache_spec
    expected = {
        "gemma2": ((0, WINDOW), ((1, 3), (0, 2))),
        "gemma3": ((0, WINDOW, WINDOW), ((2, 5), (0, 1), (3, 4))),
        "mistral": ((WINDOW,), ((0, 1, 2, 3),)),
        "qwen2": ((0, WINDOW), ((0, 1), (2, 3))),
    }[name]
    assert (spec.windows, spec.layer_groups) == expected


def test_alone_matches_transformers(family):
    _, path, prompts, expected = family
    llm = _llm(path)
    for prompt, want in zip(prompts, expected):
        assert _tokens(llm, [prompt]) == [want]
    _assert_all_free(llm)


def test_batched_matches_transformers(family):
    _, path, prompts, expected = family
    llm = _llm(path)
    assert _tokens(llm, prompts) == expected
    _assert_all_free(llm)


@pytest.mark.parametrize("chunk", [3, WINDOW + 4])
def test_chunked_prefill_matches_transformers(family, chunk):
    """Chunks shorter and longer than the window: blocks slide out between chunks."""
    _, path, prompts, expected = family
    llm = _llm(path, max_num_batched_tokens=chunk, max_num_seqs=2)
    assert _tokens(llm, prompts) == expected
    _assert_all_free(llm)


def test_prefix_hits_match_transformers(family):
    """Requests sharing a prefix longer than the window hit its last window's blocks."""
    import random

    _, path, _, _ = family
    rng = random.Random(3)
    shared = [rng.randrange(3, 259) for _ in range(3 * WINDOW + 2)]
    prompts = [shared + [rng.randrange(3, 259) for _ in range(n)] for n in (1, 4, 9)]
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm = _llm(path)
    assert _tokens(llm, prompts[:1]) == expected[:1]
    outs = llm.generate(prompts[1:], _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[1:]
    assert [o.num_cached_tokens for o in outs] == [len(shared) // BLOCK * BLOCK] * 2
    _assert_all_free(llm)


def test_preemption_matches_transformers(family):
    from engine.core.kv_cache_groups import max_blocks_per_request

    _, path, prompts, expected = family
    windows = _llm(path).engine.runner.kv_cache_spec.windows
    # room for the largest request and a little more: the others preempt one another
    most = max(max_blocks_per_request(windows, BLOCK, len(p) + MAX_NEW, 512) for p in prompts)
    llm = _llm(path, num_gpu_blocks_override=most + 2)
    assert _tokens(llm, prompts) == expected
    assert llm.engine.scheduler.num_preemptions_total > 0
    _assert_all_free(llm)


def test_sliding_groups_hold_only_the_window(family):
    """Decoding far past the window: after the prefill step a sliding group holds at most the
    blocks one query's window touches; full groups keep every block."""
    _, path, prompts, _ = family
    llm = _llm(path)
    kv = llm.engine.scheduler.kv_cache_manager
    llm.engine.add_request("long", prompts[-1], _greedy(40))
    llm.engine.step()  # the prefill: its queries read the whole prompt
    peak = [0] * kv.num_groups
    for _ in range(100):
        if not llm.engine.has_unfinished_requests():
            break
        llm.engine.step()
        kv.check_integrity()
        for g, group in enumerate(kv.groups):
            held = sum(b is not None for b in group.req_to_blocks.get("long", []))
            peak[g] = max(peak[g], held)
    assert not llm.engine.has_unfinished_requests()
    num_kv_tokens = len(prompts[-1]) + 40 - 1
    for group, most in zip(kv.groups, peak):
        if group.window:  # keys i - W < j <= i span at most cdiv(W - 1, block) + 1 blocks
            assert most == -(-(WINDOW - 1) // BLOCK) + 1
        else:
            assert most == -(-num_kv_tokens // BLOCK)
    assert any(group.window for group in kv.groups)
    _assert_all_free(llm)


def test_never_fits_counts_the_real_need(tmp_path):
    """A pool far smaller than max_model_len full blocks still serves long requests when the
    layers are windowed: check_fits uses the sliding need, not every block."""
    path = build_windowed_dir(tmp_path / "m", "mistral")
    # window 8, block 4: at most cdiv(8 + 8 - 2, 4) + 1 = 5 blocks per request at chunk 8
    llm = _llm(path, num_gpu_blocks_override=6, max_num_batched_tokens=8)
    prompt = window_prompts()[-1]
    assert _tokens(llm, [prompt], 60) == hf_greedy(path, [prompt], 60)
    _assert_all_free(llm)


def test_a_window_as_long_as_the_context_is_full_attention(tmp_path):
    """sliding_window >= max_model_len hides no token: one full group, plain attention."""
    path = build_windowed_dir(tmp_path / "m", "mistral")
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, max_model_len=WINDOW)
    assert llm.engine.runner.kv_cache_spec.windows == (0,)
    assert not llm.engine.scheduler.is_hybrid
    prompt = window_prompts()[0]
    assert _tokens(llm, [prompt], 5) == hf_greedy(path, [prompt], 5)


def test_a_backend_without_windows_is_refused_at_start(tmp_path, monkeypatch):
    from pagedserve_kernels.reference import TorchAttentionBackend

    path = build_windowed_dir(tmp_path / "m", "gemma2")
    monkeypatch.setattr(TorchAttentionBackend, "supports_softcap", False)
    with pytest.raises(ValueError, match="no softcap support"):
        _llm(path)
    monkeypatch.setattr(TorchAttentionBackend, "supports_sliding_window", False)
    with pytest.raises(ValueError, match="no window support"):
        _llm(path)
