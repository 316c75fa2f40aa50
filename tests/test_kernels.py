"""Kernels against the per-sequence torch reference on random paged caches.

The Triton kernels run on CPU under TRITON_INTERPRET=1 (set before triton is imported) and on
CUDA where a GPU is present (marker `gpu`). Outputs and caches are poisoned with NaN before each
run, so an element the kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from window_attention import (  # noqa: E402
    POISON_BLOCKS,
    WINDOW_CASES,
    case_id,
    ragged_meta,
    window_inputs,
)

from pagedserve_kernels import default_block_size, get_attention_backend, resolve_backend_name  # noqa: E402
from pagedserve_kernels.backend import AttentionMetadata  # noqa: E402
from pagedserve_kernels.reference import paged_attention, paged_decode_attention  # noqa: E402

triton_attention = pytest.importorskip("pagedserve_kernels.triton_attention")
# Triton runs interpreted on CPU and compiled where a GPU is present.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (block_size, num_heads, num_kv_heads, head_dim, context lengths)
DECODE_CASES = [
    (16, 4, 4, 64, [1, 16, 17, 40]),  # MHA; 16 ends exactly on a block boundary
    (16, 8, 2, 128, [31, 32, 5]),  # GQA 4:1, head_dim 128
    (8, 9, 3, 64, [24, 1, 13]),  # GQA 3:1 (group not a power of two), 24 = 3 full blocks
    (32, 6, 1, 64, [64, 33]),  # MQA
    (256, 4, 2, 64, [256, 300]),  # flash-attn 2 sized blocks, tiles smaller than a block
]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def make_paged_batch(block_size, num_kv_heads, head_dim, seq_lens, dtype, device, seed=0):
    """Random caches with each sequence's blocks scattered in shuffled order, spare blocks NaN."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = [-(n // -block_size) for n in seq_lens]
    total = sum(num_blocks) + 3  # spare blocks that no table points at
    shape = (total, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(total, generator=gen)
    block_table = torch.zeros(len(seq_lens), max(num_blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(num_blocks):
        block_table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    spare = perm[used:]
    k_cache[spare] = float("nan")  # a read past a table's end would surface as NaN
    v_cache[spare] = float("nan")
    for i, n in enumerate(seq_lens):  # slots past each sequence's length are never valid either
        last = int(block_table[i, num_blocks[i] - 1])
        k_cache[last, n - (num_blocks[i] - 1) * block_size :] = float("nan")
        v_cache[last, n - (num_blocks[i] - 1) * block_size :] = float("nan")
    to = dict(device=device)
    return k_cache.to(**to), v_cache.to(**to), block_table.to(**to)


def decode_meta(block_table, seq_lens, device) -> AttentionMetadata:
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table,
        query_lens_cpu=[1] * n,
        seq_lens_cpu=list(seq_lens),
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )


def _check_triton_decode(case, device, dtype, tol):
    block_size, num_heads, num_kv_heads, head_dim, seq_lens = case
    k_cache, v_cache, block_table = make_paged_batch(
        block_size, num_kv_heads, head_dim, seq_lens, dtype, device
    )
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(device=device, dtype=dtype)
    meta = decode_meta(block_table, seq_lens, device)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    triton_attention.paged_decode_attention(
        q, k_cache, v_cache, block_table, meta.seq_lens, scale, out=out
    )
    want = _oracle(q, k_cache, v_cache, meta, scale)
    assert not out.isnan().any(), "unwritten or NaN-contaminated output"
    assert _rel_err(out, want) < tol


def _oracle(q, k_cache, v_cache, meta, scale):
    """The per-sequence reference in float32 on the CPU."""
    cpu = AttentionMetadata(
        slot_mapping=meta.slot_mapping.cpu(),
        query_start_loc=meta.query_start_loc.cpu(),
        seq_lens=meta.seq_lens.cpu(),
        block_table=meta.block_table.cpu(),
        query_lens_cpu=meta.query_lens_cpu,
        seq_lens_cpu=meta.seq_lens_cpu,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
    )
    f32 = [t.float().cpu() for t in (q, k_cache, v_cache)]
    return paged_attention(*f32, cpu, scale)


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}/{c[2]}-d{c[3]}")
def test_triton_decode_matches_reference(case):
    _check_triton_decode(case, DEVICE, torch.float32, 1e-5)


def test_triton_store_kv_writes_slots_and_skips_padding():
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 2, 64
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([17, 3, 95, -1, 40], dtype=torch.int64)  # -1: a padding row
    key = torch.randn(5, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(5, num_kv_heads, head_dim, generator=gen)
    on = [t.to(DEVICE) for t in (key, value, k_cache, v_cache, slots)]
    triton_attention.store_kv(*on)
    k_cache, v_cache = on[2].cpu(), on[3].cpu()
    keep = slots >= 0
    k_ref.view(-1, num_kv_heads, head_dim)[slots[keep]] = key[keep]
    v_ref.view(-1, num_kv_heads, head_dim)[slots[keep]] = value[keep]
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_triton_store_kv_strided_input():
    # k_proj output views can be strided; the kernel must still store the right elements.
    num_kv_heads, head_dim = 2, 64
    k_cache = torch.full((2, 16, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    kv = torch.randn(32, 2, num_kv_heads, head_dim, device=DEVICE)
    key, value = kv[:, 0], kv[:, 1]  # non-contiguous rows
    triton_attention.store_kv(key, value, k_cache, v_cache, torch.arange(32, device=DEVICE))
    assert torch.equal(k_cache.view(32, num_kv_heads, head_dim), key)
    assert torch.equal(v_cache.view(32, num_kv_heads, head_dim), value)


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}/{c[2]}-d{c[3]}")
def test_batched_torch_decode_matches_per_sequence(case):
    block_size, num_heads, num_kv_heads, head_dim, seq_lens = case
    k_cache, v_cache, block_table = make_paged_batch(
        block_size, num_kv_heads, head_dim, seq_lens, torch.float32, "cpu", seed=2
    )
    # The batched path gathers whole blocks under a length mask: NaN in a masked slot would
    # leak through 0 * NaN, and a real cache never holds NaN, so zero the poison here.
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    q = torch.randn(len(seq_lens), num_heads, head_dim)
    meta = decode_meta(block_table, seq_lens, "cpu")
    got = paged_decode_attention(
        q, k_cache, v_cache, block_table, meta.seq_lens, meta.max_seq_len, head_dim**-0.5
    )
    want = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def mixed_batch(query_lens, seq_lens):
    """A float32 batch of 6 query heads over 2 KV heads (d=64, blocks of 8): (q, k_cache,
    v_cache, meta), the cache's NaN poison zeroed (the batched paths mask whole blocks)."""
    k_cache, v_cache, block_table = make_paged_batch(8, 2, 64, seq_lens, torch.float32, "cpu")
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    meta = ragged_meta(block_table, query_lens, seq_lens)
    return torch.randn(sum(query_lens), 6, 64), k_cache, v_cache, meta


def test_mixed_batch_decode_rows_batched_match_per_sequence():
    # decodes interleaved with a prefill chunk (7 new of 20) and a whole prompt (4 of 4)
    query_lens, seq_lens = [1, 7, 1, 4, 1], [5, 20, 17, 4, 33]
    q, k_cache, v_cache, meta = mixed_batch(query_lens, seq_lens)
    got = get_attention_backend("torch", "cpu").forward(q, k_cache, v_cache, meta, 0.125)
    want = paged_attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_mixed_split_built_once_per_step_consecutive_decodes_as_one_slice(monkeypatch):
    """Decodes first, as the scheduler orders a step, then a prefill chunk: the decode rows go
    as one slice; the step's first layer builds the split, its other layers reuse it, and the
    next step (a new metadata object) builds its own."""
    import pagedserve_kernels.reference as ref

    query_lens, seq_lens = [1, 1, 1, 7], [5, 17, 33, 20]
    q, k_cache, v_cache, meta = mixed_batch(query_lens, seq_lens)
    built = []
    real = ref.mixed_plan
    monkeypatch.setattr(ref, "mixed_plan", lambda m, dev: built.append(m) or real(m, dev))
    backend = get_attention_backend("torch", "cpu")
    want = paged_attention(q, k_cache, v_cache, meta, 0.125)
    for _ in range(3):  # three layers of one step
        got = backend.forward(q, k_cache, v_cache, meta, 0.125)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert built == [meta]
    assert backend._mixed[1].decode_rows == slice(0, 3)
    next_step = ragged_meta(meta.block_table, query_lens, seq_lens)
    got = backend.forward(q, k_cache, v_cache, next_step, 0.125)
    assert len(built) == 2 and built[1] is next_step
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_equal_prefills_batched_match_per_sequence(monkeypatch):
    # two whole prompts of 12, three chunks of 5 new over 21, one odd chunk, two decodes
    query_lens = [12, 5, 1, 12, 5, 3, 5, 1]
    seq_lens = [12, 21, 30, 12, 21, 21, 21, 9]
    q, k_cache, v_cache, meta = mixed_batch(query_lens, seq_lens)
    import pagedserve_kernels.reference as ref

    groups = []
    real = ref.attend_group
    monkeypatch.setattr(ref, "attend_group", lambda *a: groups.append(sorted(a[4])) or real(*a))
    got = get_attention_backend("torch", "cpu").forward(q, k_cache, v_cache, meta, 0.125)
    assert groups == [[0, 3], [1, 4, 6]]  # the odd chunk runs alone
    want = paged_attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_torch_backend_batches_decode_rows(monkeypatch):
    backend = get_attention_backend("torch", "cpu")
    seen = []
    real = backend.decode
    monkeypatch.setattr(
        backend, "decode", lambda q, *a, **kw: seen.append(q.shape[0]) or real(q, *a, **kw)
    )
    k_cache, v_cache, block_table = make_paged_batch(16, 2, 64, [5, 9, 3], torch.float32, "cpu")
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    backend.forward(
        torch.randn(3, 2, 64), k_cache, v_cache, decode_meta(block_table, [5, 9, 3], "cpu"), 0.1
    )
    mixed = ragged_meta(block_table, [1, 2, 1], [5, 9, 3])
    backend.forward(torch.randn(4, 2, 64), k_cache, v_cache, mixed, 0.1)
    assert seen == [3, 2]  # all three decodes, then the two decodes of the mixed batch


def test_auto_backend_on_cpu_is_torch_and_block_size_16():
    assert resolve_backend_name("auto", "cpu") == "torch"
    assert default_block_size("auto", "cpu") == 16
    assert get_attention_backend("auto", "cpu").name == "torch"


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU refusal")
def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton", "cpu")


def test_triton_backend_through_engine_matches_torch(tiny_model_dir):
    """Greedy tokens with the triton backend (interpreted on CPU) equal the torch reference's."""
    from conftest import make_prompts

    from engine import LLM, SamplingParams

    prompts = make_prompts(3, seed=4, max_len=20)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_model_dir), dtype="float32", attention_backend=backend)
        assert llm.engine.runner.backend.name == backend
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[backend] = [o.outputs[0].token_ids for o in res]
    assert outs["triton"] == outs["torch"]


# ---- GPU (marker gpu; skipped without CUDA, never counted as passing on CPU) ------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}/{c[2]}-d{c[3]}")
def test_triton_decode_matches_reference_gpu(case, dtype):
    tol = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    _check_triton_decode(case, "cuda", dtype, tol)


@pytest.mark.gpu
@gpu
def test_triton_decode_large_batch_gpu():
    lens = torch.randint(1, 2000, (256,), generator=torch.Generator().manual_seed(3)).tolist()
    _check_triton_decode((16, 9, 3, 64, lens), "cuda", torch.bfloat16, 1e-2)


@pytest.mark.gpu
@gpu
def test_cuda_graph_decode_matches_eager_gpu(tiny_model_dir):
    from conftest import make_prompts

    from engine import LLM, SamplingParams

    prompts = make_prompts(5, seed=5, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(
            str(tiny_model_dir), dtype="float32", attention_backend="triton", enforce_eager=eager
        )
        assert (llm.engine.runner.decode_graphs is None) == eager
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[eager] = [o.outputs[0].token_ids for o in res]
    assert outs[False] == outs[True]


# ---- sliding windows and logit soft-capping ------------------------------------------------------
@pytest.mark.parametrize("case", WINDOW_CASES, ids=case_id)
def test_reference_window_softcap_matches_dense_definition(case):
    q, k_cache, v_cache, meta, scale, window, softcap, want, skipped = window_inputs(case)
    assert any(skipped) or window == 0 or max(meta.seq_lens_cpu) <= window + case[0]
    got = paged_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=case_id)
def test_reference_backend_window_softcap_matches_dense_definition(case, dtype):
    """TorchAttentionBackend.forward: batched decodes, grouped prefills, one-off chunks."""
    from pagedserve_kernels.reference import TorchAttentionBackend

    q, k_cache, v_cache, meta, scale, window, softcap, want, _ = window_inputs(case)
    # The batched decode gathers whole blocks under a mask; tails past a length hold stale,
    # finite KV in a real cache (the placeholders behind the window stay NaN and inf).
    k_cache[POISON_BLOCKS:] = k_cache[POISON_BLOCKS:].nan_to_num(0.0)
    v_cache[POISON_BLOCKS:] = v_cache[POISON_BLOCKS:].nan_to_num(0.0)
    args = [t.to(dtype) for t in (q, k_cache, v_cache)]
    got = TorchAttentionBackend().forward(*args, meta, scale, window=window, softcap=softcap)
    assert not got.isnan().any()
    assert _rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_reference_batched_decode_window_groups_of_equal_prefills():
    # two equal chunks (grouped) and four decodes with a window, against the per-sequence oracle
    query_lens, seq_lens = [6, 1, 6, 1, 1, 1], [40, 70, 40, 5, 33, 48]
    case = (8, 4, 2, 64, query_lens, seq_lens, 10, 0.0)
    from pagedserve_kernels.reference import TorchAttentionBackend

    q, k_cache, v_cache, meta, scale, window, softcap, want, skipped = window_inputs(case)
    assert skipped == [3, 7, 3, 0, 2, 4]
    k_cache[POISON_BLOCKS:] = k_cache[POISON_BLOCKS:].nan_to_num(0.0)
    v_cache[POISON_BLOCKS:] = v_cache[POISON_BLOCKS:].nan_to_num(0.0)
    got = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, scale, window=window)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# The Triton decode kernel with windows and caps: one new token per sequence, the blocks behind
# each window NaN/inf placeholders and the slots past each length NaN (never read).
# (block_size, num_heads, num_kv_heads, head_dim, seq_lens, window, softcap)
TRITON_WINDOW_CASES = [
    (16, 4, 1, 256, [300, 40, 17], 32, 50.0),  # Gemma's shapes, W mid-block
    (16, 8, 2, 64, [40, 8, 16, 17, 100], 16, 0.0),  # W = block size, W > some contexts
    (8, 9, 3, 64, [29, 64, 7], 13, 20.0),  # GQA 3, blocks of 8
    (32, 4, 4, 64, [50, 3, 90], 0, 30.0),  # softcap alone
    (16, 4, 2, 64, [1, 2, 33], 1, 0.0),  # W = 1
]


def _triton_window_check(case, device, dtype, tol):
    block_size, heads, kv_heads, head_dim, seq_lens, window, softcap = case
    full = (block_size, heads, kv_heads, head_dim, [1] * len(seq_lens), seq_lens, window, softcap)
    q, k_cache, v_cache, meta, scale, _, _, want, skipped = window_inputs(full, dtype=dtype)
    assert window == 0 or any(skipped)
    on = dict(device=device)
    q, k_cache, v_cache = q.to(**on), k_cache.to(**on), v_cache.to(**on)
    out = torch.full_like(q, float("nan"))
    triton_attention.paged_decode_attention(
        q, k_cache, v_cache, meta.block_table.to(**on), meta.seq_lens.to(**on), scale, out=out,
        window=window, softcap=softcap,
    )
    assert not out.isnan().any(), "unwritten output, or a read behind the window"
    assert _rel_err(out.cpu(), want) < tol


@pytest.mark.parametrize(
    "case", TRITON_WINDOW_CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-w{c[5]}-c{c[6]:g}"
)
def test_triton_decode_window_softcap_matches_dense_definition(case):
    _triton_window_check(case, DEVICE, torch.float32, 1e-5)


def test_triton_backend_window_softcap_decode_and_mixed_batches():
    """Decode-only batches take the kernel with the window and cap; mixed batches the torch
    path with them (both against the definition)."""
    backend = get_attention_backend("triton", DEVICE)
    assert backend.supports_sliding_window and backend.supports_softcap
    for case in (WINDOW_CASES[0], WINDOW_CASES[4]):  # decodes only; a mixed batch
        q, k_cache, v_cache, meta, scale, window, softcap, want, _ = window_inputs(case)
        k_cache[POISON_BLOCKS:] = k_cache[POISON_BLOCKS:].nan_to_num(0.0)
        v_cache[POISON_BLOCKS:] = v_cache[POISON_BLOCKS:].nan_to_num(0.0)
        got = backend.forward(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
        assert _rel_err(got, want) < 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", TRITON_WINDOW_CASES, ids=lambda c: f"d{c[3]}-w{c[5]}-c{c[6]:g}")
def test_triton_decode_window_softcap_gpu(case, dtype):
    _triton_window_check(case, "cuda", dtype, 1e-4 if dtype == torch.float32 else 1e-2)
