"""Our side of the flash-attn calls, checked on CPU against a stand-in `flash_attn` module.

tests/fake_flash_attn.py implements flash_attn_varlen_func and flash_attn_with_kvcache from
their documented semantics (paged KV, int32 metadata, block size % 256, bottom-right causal
mask). It is injected as sys.modules['flash_attn']; the real library runs where installed.
"""

from __future__ import annotations

import sys

import fake_flash_attn
import pytest
import torch
from conftest import make_prompts
from test_kernels import decode_meta, make_paged_batch, ragged_meta

from engine import LLM, SamplingParams
from pagedserve_kernels import default_block_size, get_attention_backend, resolve_backend_name
from pagedserve_kernels.reference import paged_attention


@pytest.fixture
def fake_fa(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # None: import fails (no FA3)
    fake_flash_attn.calls.clear()
    return fake_flash_attn


def test_explicit_flash_attn_on_cpu_uses_the_module(fake_fa):
    assert resolve_backend_name("flash_attn", "cpu") == "flash_attn"
    assert default_block_size("flash_attn", "cpu") == 256
    backend = get_attention_backend("flash_attn", "cpu", block_size=256)
    assert backend.name == "flash_attn" and backend.version == 2


def test_flash_attn_2_rejects_block_size_16(fake_fa):
    with pytest.raises(ValueError, match="multiple of 256.*got 16"):
        get_attention_backend("flash_attn", "cpu", block_size=16)


def test_flash_attn_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    with pytest.raises(ValueError, match="flash_attn.*not installed|neither"):
        get_attention_backend("flash_attn", "cpu", block_size=256)


def test_prefill_chunk_and_prefix_hit_call_varlen(fake_fa):
    # Sequence 0: whole prompt; 1: a chunk after 300 computed tokens (chunked prefill or a
    # prefix hit); 2: one token (decode inside a mixed batch).
    query_lens, seq_lens = [7, 5, 1], [7, 305, 260]
    k_cache, v_cache, block_table = make_paged_batch(256, 2, 64, seq_lens, torch.float32, "cpu")
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    meta = ragged_meta(block_table, query_lens, seq_lens)
    q = torch.randn(sum(query_lens), 4, 64)
    backend = get_attention_backend("flash_attn", "cpu", block_size=256)
    got = backend.forward(q, k_cache, v_cache, meta, 0.125)
    assert fake_fa.calls == ["flash_attn_varlen_func"]
    torch.testing.assert_close(got, paged_attention(q, k_cache, v_cache, meta, 0.125))


def test_decode_calls_with_kvcache(fake_fa):
    seq_lens = [1, 256, 257, 600]
    k_cache, v_cache, block_table = make_paged_batch(256, 1, 64, seq_lens, torch.float32, "cpu")
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    meta = decode_meta(block_table, seq_lens, "cpu")
    q = torch.randn(len(seq_lens), 3, 64)
    backend = get_attention_backend("flash_attn", "cpu", block_size=256)
    got = backend.forward(q, k_cache, v_cache, meta, 0.125)
    assert fake_fa.calls == ["flash_attn_with_kvcache"]
    torch.testing.assert_close(got, paged_attention(q, k_cache, v_cache, meta, 0.125))


def test_fake_follows_the_bottom_right_mask():
    """The stand-in itself: 2 queries over 5 keys see 4 and 5 keys (flash-attn's docstring)."""
    k_cache = torch.zeros(1, 256, 1, 4)
    v_cache = torch.zeros(1, 256, 1, 4)
    v_cache[0, :5, 0, 0] = torch.arange(5.0)  # value = key position, so out = mean position
    q = torch.zeros(2, 1, 4)  # equal scores: output is the mean over visible keys
    out = fake_flash_attn.flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([0, 5], dtype=torch.int32),
        2,
        5,
        causal=True,
        block_table=torch.zeros(1, 1, dtype=torch.int32),
    )
    assert out[:, 0, 0].tolist() == [1.5, 2.0]


def test_engine_greedy_through_flash_attn_equals_reference(fake_fa, tiny_model_dir):
    shared = make_prompts(1, seed=7, min_len=270, max_len=270)[0]  # > one 256-token block
    prompts = make_prompts(3, seed=6, max_len=30) + [shared + t for t in make_prompts(2, seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = {}
    for backend in ("torch", "flash_attn"):
        # a 64-token budget splits the long prompts: chunked prefill through the varlen path
        llm = LLM(
            str(tiny_model_dir),
            dtype="float32",
            attention_backend=backend,
            block_size=256,
            max_num_batched_tokens=64,
            device="cpu",  # the stand-in computes on CPU tensors
        )
        assert llm.engine.runner.backend.name == backend
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[-2:], params, use_tqdm=False)  # prefix-cache hits
        assert all(o.num_cached_tokens >= 256 for o in again)
        outs[backend] = [o.outputs[0].token_ids for o in first + again]
    assert outs["flash_attn"] == outs["torch"]
    assert {"flash_attn_varlen_func", "flash_attn_with_kvcache"} <= set(fake_fa.calls)


def test_engine_default_block_size_is_256_on_flash_attn(fake_fa, tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", attention_backend="flash_attn", device="cpu")
    assert llm.engine.config.block_size == 256
    assert llm.engine.runner.block_size == 256


def test_flash_attn_dtype_rule_on_cuda(fake_fa):
    # Construction only: no CUDA tensor is made, so this runs on CPU machines too.
    with pytest.raises(ValueError, match="float16/bfloat16"):
        get_attention_backend("flash_attn", "cuda", 256, torch.float32)
    assert get_attention_backend("flash_attn", "cuda", 256, torch.bfloat16).name == "flash_attn"
    assert get_attention_backend("auto", "cuda", 256, torch.bfloat16).name == "flash_attn"
    assert get_attention_backend("auto", "cuda", 16, torch.float32).name == "triton"


# ---- sliding windows and soft-capping: window_size=(W - 1, 0), softcap=c -------------------------
# (query_lens, seq_lens, window, softcap) over blocks of 256 (flash-attn 2's paged-KV rule)
FA_WINDOW_CASES = [
    ([1, 1, 1, 1], [600, 256, 257, 1000], 300, 0.0),  # decode: W mid-page, W > one context
    ([7, 100, 1], [7, 700, 530], 256, 50.0),  # a prompt, a chunk, a decode in one varlen call
    ([1, 40], [900, 300], 0, 30.0),  # softcap alone
    ([300, 1], [800, 513], 1, 0.0),  # W = 1
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "case", FA_WINDOW_CASES, ids=lambda c: f"q{c[0]}-kv{c[1]}-w{c[2]}-c{c[3]:g}"
)
def test_window_softcap_reach_flash_attn_and_match_the_definition(fake_fa, case, dtype):
    from window_attention import window_inputs

    query_lens, seq_lens, window, softcap = case
    full = (256, 4, 2, 64, query_lens, seq_lens, window, softcap)
    q, k_cache, v_cache, meta, scale, _, _, want, skipped = window_inputs(full, dtype=dtype)
    assert window == 0 or window == 1 or any(skipped)
    backend = get_attention_backend("flash_attn", "cpu", block_size=256)
    assert backend.supports_sliding_window and backend.supports_softcap
    got = backend.forward(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    want_call = "flash_attn_with_kvcache" if meta.is_decode_only else "flash_attn_varlen_func"
    assert fake_fa.calls == [want_call]
    assert not got.isnan().any(), "a page behind the window was read"
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=8e-3)
    torch.testing.assert_close(got.double(), want, **tol)


def test_fake_window_size_is_flash_attn_s():
    """The stand-in itself: window_size=(1, 0) lets each of 2 queries over 5 keys see 2 keys."""
    k_cache, v_cache = torch.zeros(1, 256, 1, 4), torch.zeros(1, 256, 1, 4)
    v_cache[0, :5, 0, 0] = torch.arange(5.0)  # value = key position, so out = mean position
    out = fake_flash_attn.flash_attn_with_kvcache(
        torch.zeros(1, 2, 1, 4), k_cache, v_cache,
        cache_seqlens=torch.tensor([5], dtype=torch.int32),
        block_table=torch.zeros(1, 1, dtype=torch.int32), causal=True, window_size=(1, 0),
    )
    assert out[0, :, 0, 0].tolist() == [2.5, 3.5]
