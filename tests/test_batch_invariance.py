"""Batch invariance in bf16 (pagedserve_kernels.cpu_ops.batch_invariant, `--batch-invariant`): a
request's logits do not depend on what else runs in its step, nor on how its prompt is chunked.

The kernels first (a row of the AMX linear at any row count, a query of the prefill kernel in any
chunk, as a one-token chunk too), then the engine end to end on a tiny random-weight Llama in bf16
whose shapes the AMX kernels cover: logprobs (the logits, to the bit) alone == batched == chunked.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels.cpu_ops import BATCH_INVARIANT_ENV, batch_invariant, load_cpu_ops
from tests.conftest import build_tiny_model_dir, make_prompts

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(
    ops is None or not ops.dense_linear_kernel() or not ops.prefill_supported(64, 16),
    reason="batch invariance is built on dense_linear and the prefill kernel (AMX or AVX-512 BF16)",
)


def test_the_flag_reads_pagedserve_and_vllm_env_vars(monkeypatch):
    for name in BATCH_INVARIANT_ENV:
        monkeypatch.delenv(name, raising=False)
    assert not batch_invariant()
    for name in BATCH_INVARIANT_ENV:
        monkeypatch.setenv(name, "1")
        assert batch_invariant()
        monkeypatch.setenv(name, "0")
        assert not batch_invariant()


@pytest.mark.parametrize("bias", [False, True])
def test_dense_linear_row_bits_do_not_depend_on_the_row_count(bias):
    """Every row count (1, decode sizes, prefill sizes) gives each row the bits it gets alone;
    the bias is added in float32 before the one rounding."""
    gen = torch.Generator().manual_seed(3)
    n, k = 1056, 96  # wider than the narrow-linear cut: oneDNN would take the large calls
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    packed = ops.amx_pack_weight(w)
    x = torch.randn(70, k, generator=gen).bfloat16()
    alone = torch.empty(70, n, dtype=torch.bfloat16)
    for r in range(70):
        ops.dense_linear(alone[r : r + 1], x[r : r + 1], packed, b)
    for m in (2, 16, 17, 32, 33, 70):
        out = torch.empty(m, n, dtype=torch.bfloat16)
        ops.dense_linear(out, x[:m], packed, b)
        assert torch.equal(out, alone[:m]), f"{m} rows"
    want = x.float() @ w.float().T + (0 if b is None else b.float())
    torch.testing.assert_close(alone.float(), want.bfloat16().float(), rtol=2**-7, atol=1e-3)


def _cache_with_sequence(gen, length: int, kv_heads: int, d: int, block_size: int = 16):
    """A paged cache holding one sequence's keys and values in shuffled blocks."""
    num_blocks = -(length // -block_size) + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen).bfloat16()
    table = torch.randperm(num_blocks, generator=gen)[: -(length // -block_size)]
    return k_cache, v_cache, table.to(torch.int32)[None, :]


def _prefill(query, k_cache, v_cache, table, chunks: list[int], scale: float):
    """The query rows of one sequence attended chunk by chunk (each chunk one kernel call,
    seeing the keys up to its last query), as chunked prefill runs them."""
    out = torch.empty_like(query)
    done = 0
    for n in chunks:
        i32 = torch.int32
        ops.paged_attention_prefill(
            out[done : done + n], query[done : done + n].contiguous(), k_cache, v_cache, table,
            torch.tensor([0], dtype=i32), torch.tensor([n], dtype=i32),
            torch.tensor([done + n], dtype=i32), scale,
        )
        done += n
    return out


def test_prefill_kernel_query_bits_do_not_depend_on_its_chunk():
    """The same query gets the same bits in a whole prompt, in chunks that split its 16-query
    blocks elsewhere, and as a one-token chunk (how batch-invariant decode steps run it)."""
    gen = torch.Generator().manual_seed(7)
    length, heads, kv_heads, d = 75, 4, 2, 64
    k_cache, v_cache, table = _cache_with_sequence(gen, length, kv_heads, d)
    query = torch.randn(length, heads, d, generator=gen).bfloat16()
    scale = d**-0.5
    whole = _prefill(query, k_cache, v_cache, table, [length], scale)
    for chunks in ([5, 30, 1, 1, 38], [1] * length, [17, 16, 42]):
        assert torch.equal(_prefill(query, k_cache, v_cache, table, chunks, scale), whole), chunks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """head_dim 64 (the AMX attention kernels), gate_up wider than the narrow-linear cut, a
    vocabulary of whole 16-column tiles (the AMX lm_head)."""
    return build_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-llama-bi"),
        seed=2,
        hidden_size=256,
        intermediate_size=768,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=272,
        initializer_range=0.05,
    )


def _logprobs(model_dir, prompts, monkeypatch, invariant: bool, alone: bool, **engine_args):
    from engine import LLM, SamplingParams

    monkeypatch.setenv(BATCH_INVARIANT_ENV[0], "1" if invariant else "0")
    monkeypatch.delenv(BATCH_INVARIANT_ENV[1], raising=False)
    llm = LLM(str(model_dir), dtype="bfloat16", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=4)
    if alone:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_logits_alone_equal_batched_and_chunked(model_dir, monkeypatch):
    """Each prompt alone, all batched (prefill rows beside decode rows of others), chunked under
    a 7-token budget (one-token chunks, chunks cut mid 16-query block), and with a prefix cache
    hit on a 128-token shared prefix over 9 sequences (where the cascade would decode): the same
    tokens and logprobs, to the bit."""
    shared = make_prompts(1, seed=11, min_len=130, max_len=130)[0]
    prompts = make_prompts(5, seed=5, min_len=2, max_len=45)
    prompts += [shared + tail for tail in make_prompts(9, seed=6, min_len=1, max_len=9)]
    args = dict(enable_prefix_caching=False)
    alone = _logprobs(model_dir, prompts, monkeypatch, True, alone=True, **args)
    batched = _logprobs(model_dir, prompts, monkeypatch, True, alone=False, **args)
    chunked = _logprobs(
        model_dir, prompts, monkeypatch, True, alone=False, max_num_batched_tokens=7, **args
    )
    # only the sharing sequences, so every decode row shares the prefix (the cascade's case)
    cached = _logprobs(model_dir, prompts[5:], monkeypatch, True, alone=False)
    for name, other in (("batched", batched), ("chunked", chunked), ("prefix-cached", cached)):
        same = [a == b for a, b in zip(alone[len(alone) - len(other) :], other)]
        assert all(same), f"{name}: prompts {[i for i, s in enumerate(same) if not s]} differ"
