"""The fused CPU kernels (pagedserve_kernels/csrc/) against the torch ops they replace, and their
build.

Each op is compared with its oracle: RMSNorm._norm, apply_rope, F.silu, the paged attention
references in pagedserve_kernels/reference.py and F.linear. Outputs are pre-filled with NaN so an
element a kernel forgets to write fails, paged caches carry NaN in every slot no sequence owns so a
read past a sequence's end fails, and padding around strided views is checked untouched.

Reduced-precision results are held to "one rounding of the float32 result": within one unit in
the last place everywhere and bit-equal almost everywhere, which a kernel that drops or adds a
rounding step (or reads the wrong element) does not meet.

The kernels must build on a machine with a C++ compiler: a None from load_cpu_ops() errors every
test that uses them, unless PAGEDSERVE_CPU_KERNELS=0 turns them off (then they are skipped).
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from window_attention import window_inputs

import pagedserve_kernels.cpu_linear as cpu_linear
from engine.layers import RMSNorm, RotaryEmbedding, apply_rope
from pagedserve_kernels.backend import AttentionMetadata
from pagedserve_kernels.cpu_backend import PREFILL_D256_MAX_KEYS, CpuAttentionBackend
from pagedserve_kernels.cpu_linear import (
    AMX_MAX_ROWS,
    AMX_NARROW_MAX_OUT,
    ONEDNN_MIN_ROW_STEP,
    PackedLinear,
    can_pack,
    onednn_rows,
    pack_linears,
)
from pagedserve_kernels.cpu_ops import CSRC, build_key, cpu_kernels_enabled, load_cpu_ops, sources
from pagedserve_kernels.reference import (
    TorchAttentionBackend,
    gather_kv,
    paged_attention,
    paged_decode_attention,
    write_kv_by_slot,
)

# One unit in the last place, relative: the largest gap one rounding step can open.
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
THREADS = 2  # the decode kernel's per-sequence path needs batch >= 2 * intra-op threads


@pytest.fixture(scope="module")
def ops():
    if not cpu_kernels_enabled():
        pytest.skip("PAGEDSERVE_CPU_KERNELS=0: the CPU kernels are turned off")
    loaded = load_cpu_ops()
    assert loaded is not None, (
        "the kernels in pagedserve_kernels/csrc/ did not build "
        "(see the warning load_cpu_ops logged); "
        "set PAGEDSERVE_CPU_KERNELS=0 only on a machine without a C++ compiler"
    )
    return loaded


def _amx_available() -> bool:
    if not cpu_kernels_enabled():
        return False
    loaded = load_cpu_ops()
    return loaded is not None and bool(loaded.amx_available())


needs_amx = pytest.mark.skipif(
    not _amx_available(),
    reason="no AMX here: the CPU lacks amx_tile/amx_bf16, the kernels were built without "
    "them, or the kernel could not get AMX state from Linux (ARCH_REQ_XCOMP_PERM)",
)


def _prefill_available() -> bool:
    """paged_attention_prefill runs here (AMX, or AVX-512 BF16 vectors)."""
    if not cpu_kernels_enabled():
        return False
    loaded = load_cpu_ops()
    return loaded is not None and bool(loaded.prefill_supported(64, 16))


def _dense_available() -> bool:
    """dense_linear (and so the fused decode step) runs here: AMX, or AVX-512 BF16 vectors."""
    if not cpu_kernels_enabled():
        return False
    loaded = load_cpu_ops()
    return loaded is not None and loaded.dense_linear_kernel() != ""


needs_dense_linear = pytest.mark.skipif(
    not _dense_available(),
    reason="no dense_linear here: the CPU (or the build) has neither AMX nor AVX-512 BF16",
)


@contextlib.contextmanager
def _kernel_body(body: str, set_amx, kernel):
    """A kernel on the named body ("amx" or "avx512_bf16") for the duration: set_amx(bool)
    switches it and returns the old setting, kernel() names the body that runs; skips where
    AMX is asked for and absent."""
    if body == "amx" and not _amx_available():
        pytest.skip("no AMX here")
    previous = set_amx(body == "amx")
    try:
        assert kernel() == body
        yield
    finally:
        set_amx(previous)


def dense_body(ops, body: str):
    """dense_linear on the named body for the duration."""
    return _kernel_body(body, ops.set_amx_dense_linear, ops.dense_linear_kernel)


needs_prefill_kernel = pytest.mark.skipif(
    not _prefill_available(),
    reason="no prefill kernel here: the CPU (or the build) has neither AMX nor AVX-512 BF16",
)

# the prefill kernel's bodies: each test of it runs both where the CPU has AMX
PREFILL_BODIES = ["amx", "avx512_bf16"]


def prefill_body(ops, body: str):
    """paged_attention_prefill (and the cascade) on the named body for the duration."""
    return _kernel_body(body, ops.set_amx_prefill, lambda: ops.prefill_kernel(64, 16))


@contextlib.contextmanager
def num_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _spy(ops, calls):
    """ops whose every call is recorded by name in `calls`."""

    class Spy:
        def __getattr__(self, name):
            fn = getattr(ops, name)
            return lambda *args: (calls.append(name), fn(*args))[1]

    return Spy()


def assert_one_rounding(got: torch.Tensor, want32: torch.Tensor, min_exact: float = 0.99):
    """got equals want32 (a float32 oracle) rounded to got's dtype, bar rare one-ulp flips."""
    assert not got.isnan().any(), "unwritten (NaN) output elements"
    rounded = want32.to(got.dtype)
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want32, rtol=1e-5, atol=1e-6)
        return
    torch.testing.assert_close(got.float(), rounded.float(), rtol=ULP[got.dtype], atol=1e-6)
    exact = (got == rounded).float().mean().item()
    assert exact >= min_exact, f"only {exact:.2%} of elements are the correctly rounded value"


def _weight(n: int, dtype, gen) -> torch.Tensor:
    return (1.0 + 0.5 * torch.randn(n, generator=gen)).to(dtype)


# ---- RMSNorm ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 200])
def test_rms_norm_matches_hf_rounding(ops, dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    rows, eps = 37, 1e-5  # more rows than one parallel grain (16)
    norm = RMSNorm(hidden, eps)
    norm.weight.data = _weight(hidden, dtype, gen)
    # x and out as row views of wider buffers: the kernel must honour both row strides.
    x_buf = (3.0 * torch.randn(rows, hidden + 8, generator=gen)).to(dtype)
    x_buf[0] *= 1e-3  # a row whose mean square is eps-sized: eps must be added, not dropped
    x = x_buf[:, :hidden]
    out_buf = torch.full((rows, hidden + 8), 7.0, dtype=dtype)
    out = out_buf[:, :hidden].fill_(float("nan"))
    x_before = x_buf.clone()

    ops.rms_norm(out, x, norm.weight.data, eps)

    want = norm._norm(x)  # Hugging Face: normalize in float32, round, then weight * in dtype
    assert_one_rounding(out, want.float())
    assert torch.equal(out_buf[:, hidden:], torch.full((rows, 8), 7.0, dtype=dtype))
    assert torch.equal(x_buf, x_before), "rms_norm wrote to its input"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_updates_residual_and_x_in_place(ops, dtype):
    gen = torch.Generator().manual_seed(1)
    rows, hidden, eps = 33, 200, 1e-6
    norm = RMSNorm(hidden, eps)
    norm.weight.data = _weight(hidden, dtype, gen)
    x = (2.0 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    residual = (5.0 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    x[0], residual[0] = x[0] * 1e-3, residual[0] * 1e-3  # mean square ~30 * eps
    want_x, want_residual = norm._norm(x + residual), x + residual  # the torch path's rounding

    ops.fused_add_rms_norm(x, residual, norm.weight.data, eps)

    assert torch.equal(residual, want_residual), "residual must be x + residual in dtype, exactly"
    assert_one_rounding(x, want_x.float())


# ---- RoPE ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 1, 128), (6, 3, 80)])
def test_rotary_embedding_in_place_on_fused_qkv(ops, dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim + heads)
    tokens, max_pos = 37, 700
    rotary = RotaryEmbedding(head_dim, 10000.0)
    cache = rotary.cos_sin_cache(max_pos, dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    positions[:2] = torch.tensor([0, max_pos - 1])
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    before = qkv.clone()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # views, row stride = qkv width
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)

    ops.rotary_embedding(positions, q, k, cache)

    cos, sin = rotary(positions, dtype)  # the torch path's per-token cos/sin
    half = head_dim // 2
    assert torch.equal(cache[positions, :half], cos[:, 0, :half]), "cache cos != forward()'s"
    assert torch.equal(cache[positions, half:], sin[:, 0, :half]), "cache sin != forward()'s"
    q0, k0, v0 = before.split([q_size, kv_size, kv_size], dim=-1)
    q0, k0 = q0.reshape(tokens, heads, head_dim), k0.reshape(tokens, kv_heads, head_dim)
    # The kernel rotates in float32 and rounds once; apply_rope in dtype rounds three times.
    cos32, sin32 = cos.float(), sin.float()
    assert_one_rounding(q, apply_rope(q0.float(), cos32, sin32))
    assert_one_rounding(k, apply_rope(k0.float(), cos32, sin32))
    tol = dict(rtol=4 * ULP[dtype], atol=4 * ULP[dtype])
    torch.testing.assert_close(q, apply_rope(q0, cos, sin), **tol)
    torch.testing.assert_close(k, apply_rope(k0, cos, sin), **tol)
    assert torch.equal(v, v0), "the v part of qkv must be left alone"


# ---- SiLU and mul -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [40, 128])  # 40: a 16-lane vector body plus a scalar tail
def test_silu_and_mul_matches_torch(ops, dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    rows = 9
    x = (4.0 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype)
    x[0, :6] = torch.tensor([0.0, -30.0, 30.0, -100.0, 100.0, 1e-3])  # exp's clamped range
    out = torch.full((rows, inter), float("nan"), dtype=dtype)

    ops.silu_and_mul(out, x)

    # torch rounds silu to dtype, then the product: one rounding of the float32 product.
    assert_one_rounding(out, (F.silu(x[:, :inter]).float() * x[:, inter:].float()))
    want = F.silu(x[:, :inter]) * x[:, inter:]
    torch.testing.assert_close(out, want, rtol=max(ULP[dtype], 1e-5), atol=1e-6)


# ---- writing new K/V into the paged cache -------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [3, 200])  # 200: more than one parallel grain of rows
def test_write_kv_equals_index_copy_on_strided_views(ops, dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    kv_heads, d, blocks, bs = 3, 64, 40, 16
    # key and value as the model hands them over: views of one fused qkv row per token
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * d, generator=gen).to(dtype)
    key = qkv[:, 9 * d : (9 + kv_heads) * d].view(tokens, kv_heads, d)
    value = qkv[:, (9 + kv_heads) * d :].view(tokens, kv_heads, d)
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
    k_cache = torch.full((blocks, bs, kv_heads, d), float("nan"), dtype=dtype)
    v_cache = torch.full((blocks, bs, kv_heads, d), float("nan"), dtype=dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_by_slot(key, value, want_k, want_v, slots)

    ops.write_kv(key, value, k_cache, v_cache, slots)

    # bit-equal, the NaN of every slot no token was written to included
    assert torch.equal(_bits(k_cache), _bits(want_k))
    assert torch.equal(_bits(v_cache), _bits(want_v))
    assert k_cache.view(-1, kv_heads, d)[slots].isnan().sum() == 0
    assert v_cache.isnan().sum() == (blocks * bs - tokens) * kv_heads * d


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def test_write_kv_refuses_bad_arguments(ops):
    k_cache = torch.zeros(4, 16, 2, 64)
    key = torch.randn(3, 2, 64)
    ok = torch.tensor([0, 5, 63])
    for bad in ([0, 64, 1], [0, -1, 1]):  # past the cache, negative
        with pytest.raises(RuntimeError, match="slot outside the cache"):
            ops.write_kv(key, key, k_cache, k_cache.clone(), torch.tensor(bad))
    with pytest.raises(RuntimeError, match="one slot per token"):
        ops.write_kv(key, key, k_cache, k_cache.clone(), ok[:2])
    with pytest.raises(RuntimeError, match="dtypes must agree"):
        ops.write_kv(key.bfloat16(), key.bfloat16(), k_cache, k_cache.clone(), ok)
    with pytest.raises(RuntimeError, match="head shapes"):
        ops.write_kv(torch.randn(3, 1, 64), torch.randn(3, 1, 64), k_cache, k_cache.clone(), ok)
    with pytest.raises(RuntimeError, match="slots"):
        ops.write_kv(key, key, k_cache, k_cache.clone(), ok.int())
    assert torch.equal(k_cache, torch.zeros(4, 16, 2, 64)), "a refused call wrote to the cache"


def test_torch_backend_writes_kv_through_the_kernel(ops):
    calls: list[str] = []
    backend = CpuAttentionBackend(_spy(ops, calls))
    key, value = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    slots = torch.tensor([3, 17, 18, 40, 63])
    backend.write_kv(key, value, k_cache, v_cache, slots)
    assert calls == ["write_kv"]
    assert torch.equal(k_cache.view(-1, 2, 64)[slots], key)
    assert torch.equal(v_cache.view(-1, 2, 64)[slots], value)


# ---- paged decode attention ---------------------------------------------------------------------
def make_paged(block_size, kv_heads, head_dim, seq_lens, dtype, gen):
    """Caches whose blocks are scattered in shuffled order; every slot no sequence owns is NaN."""
    num_blocks = [-(n // -block_size) for n in seq_lens]
    total = sum(num_blocks) + 3  # spare blocks no table points at
    shape = (total, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(total, generator=gen)
    block_table = torch.zeros(len(seq_lens), max(num_blocks) + 1, dtype=torch.int32)  # spare col
    used = 0
    for i, n in enumerate(num_blocks):
        block_table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    for cache in (k_cache, v_cache):
        cache[perm[used:]] = float("nan")
        for i, n in enumerate(seq_lens):  # past each sequence's end in its last block
            cache[block_table[i, num_blocks[i] - 1], n - (num_blocks[i] - 1) * block_size :] = (
                float("nan")
            )
    return k_cache, v_cache, block_table


def decode_meta(block_table, seq_lens) -> AttentionMetadata:
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        query_lens_cpu=[1] * n,
        seq_lens_cpu=list(seq_lens),
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )


# (kernel path at THREADS threads, block_size, num_heads, num_kv_heads, head_dim, seq_lens)
# Lengths 16, 24, 32, 64 end on a block boundary; 1, 9, 17, 33, ... end inside one.
DECODE_CASES = [
    ("per-seq", 16, 8, 2, 64, [1, 16, 17, 40, 64, 5]),  # GQA 4
    ("per-seq", 8, 9, 3, 128, [24, 1, 13, 31, 100]),  # GQA 3
    ("per-seq", 8, 4, 4, 64, [8, 9, 63, 2]),  # MHA
    ("per-seq", 16, 4, 1, 128, [300, 7, 16, 33]),  # MQA, a longer context
    ("per-head", 16, 8, 2, 64, [33, 16]),
    ("per-head", 8, 9, 3, 128, [24, 7, 50]),
    ("per-head", 16, 4, 4, 128, [1]),
    ("per-head", 8, 10, 2, 64, [41, 8, 19]),  # GQA 5: four query heads, then one
    ("per-seq", 16, 4, 1, 256, [300, 7, 16, 33]),  # Gemma's head_dim 256 in registers
    ("per-head", 16, 8, 2, 256, [65, 17]),  # head_dim 256, one query head at a time
    ("per-seq", 16, 8, 2, 96, [1, 16, 17, 40, 64, 5]),  # Phi-3's head_dim 96, GQA 4
    ("per-seq", 16, 6, 6, 96, [300, 7, 16, 33]),  # Phi-3-mini is MHA
    ("per-head", 16, 8, 2, 96, [33, 100]),
    ("per-head", 8, 9, 3, 80, [24, 13]),  # head_dim 80 and 112: multiples of 16 in registers
    ("per-seq", 8, 4, 4, 80, [9, 64, 3, 1]),
    ("per-seq", 16, 8, 4, 112, [17, 1, 50, 31]),
    ("per-head", 16, 10, 2, 160, [41, 8, 19]),  # two query heads at a time: four, then one
    ("per-seq", 16, 4, 2, 224, [70, 3, 16, 9]),
    ("scalar", 16, 8, 2, 32, [1, 16, 17, 40, 5]),
    ("scalar", 8, 9, 3, 48, [24, 13]),
    ("scalar", 8, 4, 4, 272, [9, 64, 3, 1]),  # past 256: the portable loop
]


def _case_id(case) -> str:
    path, bs, h, hkv, d, lens = case
    return f"{path}-bs{bs}-h{h}/{hkv}-d{d}-b{len(lens)}"


@contextlib.contextmanager
def amx_decode(ops, enabled: bool):
    """bf16 decode attention on AMX (the default where it applies) or on the AVX-512 paths."""
    previous = ops.set_amx_decode(enabled)
    try:
        yield
    finally:
        ops.set_amx_decode(previous)


# a case's path -> the kernel ops.decode_kernel names for it
KERNEL_OF_PATH = {
    "per-seq": "avx512_seq", "per-head": "avx512_head", "scalar": "portable",
    "amx-per-seq": "amx", "amx-per-head": "amx",
}


def _run_decode(ops, case, dtype, seed=0, amx=False):
    path, block_size, heads, kv_heads, head_dim, seq_lens = case
    batch = len(seq_lens)
    want_kernel = "portable" if dtype == torch.float16 else KERNEL_OF_PATH[path]
    if path.startswith("amx"):
        want_kernel = want_kernel if amx else None  # None: the AVX-512 run it is compared to
    else:
        expect_per_seq = 64 <= head_dim <= 256 and head_dim % 16 == 0 and batch >= 2 * THREADS
        expect_per_seq = expect_per_seq and dtype != torch.float16
        assert (path == "per-seq") == expect_per_seq, "case list out of step with the dispatch"
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_table = make_paged(block_size, kv_heads, head_dim, seq_lens, dtype, gen)
    # query: a strided view (as q out of a fused qkv): padded heads and head rows.
    q_buf = torch.randn(batch, heads + 2, head_dim + 16, generator=gen).to(dtype)
    query = q_buf[:, :heads, :head_dim]
    out_buf = torch.full((batch, heads, head_dim + 8), 7.0, dtype=dtype)
    out = out_buf[:, :, :head_dim].fill_(float("nan"))
    scale = head_dim**-0.5
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)

    with num_threads(THREADS), amx_decode(ops, amx):
        ops.paged_attention_decode(out, query, k_cache, v_cache, block_table, seq_lens_t, scale)
        kernel = ops.decode_kernel(query, k_cache)
    assert want_kernel is None or kernel == want_kernel, (case, kernel)

    f32 = [t.float() for t in (query, k_cache, v_cache)]
    want = paged_attention(*f32, decode_meta(block_table, seq_lens), scale)  # per sequence
    assert torch.equal(out_buf[..., head_dim:], torch.full((batch, heads, 8), 7.0, dtype=dtype))
    return out, want, (query, k_cache, v_cache, block_table, seq_lens_t, max(seq_lens), scale)


@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
def test_paged_decode_float32(ops, case):
    out, want, args = _run_decode(ops, case, torch.float32)
    assert not out.isnan().any(), "unwritten or NaN-contaminated output"
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # The batched reference (gather + masked SDPA) agrees too once the poison is zeroed.
    query, k_cache, v_cache, *rest = args
    batched = paged_decode_attention(query, k_cache.nan_to_num(0), v_cache.nan_to_num(0), *rest)
    torch.testing.assert_close(out, batched, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
def test_paged_decode_bfloat16(ops, case):
    out, want, _ = _run_decode(ops, case, torch.bfloat16, seed=1)
    assert not out.isnan().any(), "unwritten or NaN-contaminated output"
    # Inputs are exact in bf16 and the kernel accumulates in float32: one output rounding.
    torch.testing.assert_close(out.float(), want, rtol=0, atol=2e-2)
    torch.testing.assert_close(out.float(), want, rtol=ULP[torch.bfloat16], atol=1e-3)


# AMX applies to bf16 with block_size % 16 == 0, head_dim % 32 == 0 from 64 on and <= 16 query
# heads per KV head; one task per sequence when batch >= 2 * threads, else one per (sequence,
# KV head). head_dim 64k + 32 runs P x V in 64-dim passes and a last one of 96.
# The mean-error bound below holds for batches whose contexts are mostly tens of keys or more
# (a few-key context keeps more of P's bf16 rounding, at every head_dim).
AMX_DECODE_CASES = [
    ("amx-per-seq", 16, 8, 2, 96, [1, 16, 17, 40, 64, 5]),  # Phi-3's head_dim 96, GQA 4
    ("amx-per-seq", 16, 6, 6, 96, [677, 31, 2, 130]),  # MHA as Phi-3-mini, a long context
    ("amx-per-head", 16, 16, 1, 96, [49, 130]),  # 16 query heads on one KV head
    ("amx-per-seq", 32, 10, 2, 160, [33, 95, 64, 1]),  # GQA 5, a 64-dim pass then a 96-dim one
    ("amx-per-head", 16, 6, 2, 224, [40, 17]),  # GQA 3, 64 + 64 + 96 dims
    ("amx-per-seq", 16, 4, 2, 192, [70, 33, 160, 90]),
    ("amx-per-seq", 16, 8, 2, 64, [1, 16, 17, 40, 64, 5]),  # GQA 4, lengths on/off boundaries
    ("amx-per-seq", 16, 9, 3, 64, [677, 31, 2, 130]),  # SmolLM2's shapes, a long context
    ("amx-per-seq", 32, 10, 2, 128, [33, 95, 64, 1]),  # GQA 5 (4 + 1 heads), two 64-dim passes
    ("amx-per-seq", 16, 4, 4, 64, [300, 7, 16, 33]),  # MHA
    ("amx-per-head", 16, 4, 1, 128, [300, 7]),  # MQA
    ("amx-per-head", 16, 16, 1, 64, [49]),  # 16 query heads on one KV head: a full tile
]


@needs_amx
@pytest.mark.parametrize("case", AMX_DECODE_CASES, ids=_case_id)
def test_paged_decode_bfloat16_amx(ops, case):
    """The AMX kernel rounds the softmax numerators to bf16 before P x V (as flash attention
    does), so it sits within a few bf16 ulps of the float32 result, not one rounding."""
    out, want, _ = _run_decode(ops, case, torch.bfloat16, seed=4, amx=True)
    assert not out.isnan().any(), "unwritten or NaN-contaminated output"
    torch.testing.assert_close(out.float(), want, rtol=ULP[torch.bfloat16], atol=4e-3)
    err = (out.float() - want).abs()
    assert err.mean().item() < 5e-4, "mean error beyond what rounding P to bf16 explains"
    # the AMX kernel ran: the AVX-512 paths (float32 probabilities) differ in some bits
    avx, _, _ = _run_decode(ops, case, torch.bfloat16, seed=4, amx=False)
    assert not torch.equal(out, avx), "AMX switched on but the output is the AVX-512 path's"


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_paged_decode_float16_takes_the_portable_path(ops, head_dim):
    case = ("scalar", 16, 8, 2, head_dim, [1, 16, 17, 40, 5])
    out, want, _ = _run_decode(ops, case, torch.float16, seed=2)
    assert not out.isnan().any(), "unwritten or NaN-contaminated output"
    torch.testing.assert_close(out.float(), want, rtol=ULP[torch.float16], atol=2e-4)


def test_torch_backend_routes_decode_through_the_kernel(ops):
    """CpuAttentionBackend(ops) calls the kernel for decode batches and matches the reference."""
    seq_lens = [5, 16, 17, 33]
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, block_table = make_paged(16, 2, 64, seq_lens, torch.float32, gen)
    k_cache, v_cache = k_cache.nan_to_num(0), v_cache.nan_to_num(0)
    query = torch.randn(len(seq_lens), 6, 64, generator=gen)
    meta = decode_meta(block_table, seq_lens)
    calls = []

    class Spy:
        def paged_attention_decode(self, *args):
            calls.append(args[1].shape)
            ops.paged_attention_decode(*args)

    got = CpuAttentionBackend(Spy()).forward(query, k_cache, v_cache, meta, 0.125)
    want = TorchAttentionBackend().forward(query, k_cache, v_cache, meta, 0.125)
    assert calls == [query.shape]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- AMX linear ---------------------------------------------------------------------------------
def assert_matches_linear(got: torch.Tensor, want: torch.Tensor):
    """bf16 linear results: F.linear's value, bar a rare one-ulp flip from summation order."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert not got.isnan().any(), "unwritten output elements"
    torch.testing.assert_close(got.float(), want.float(), rtol=ULP[torch.bfloat16], atol=1e-5)
    exact = (got == want).float().mean().item()
    assert exact >= 0.99, f"only {exact:.2%} of elements equal F.linear's"


@needs_amx
@pytest.mark.parametrize("n,k", [(48, 64), (256, 96), (1040, 256)])  # 48, 1040: odd tile counts
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32])
def test_amx_linear_matches_f_linear(ops, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    packed = ops.amx_pack_weight(w)
    x_buf = torch.randn(m, k + 32, generator=gen).bfloat16()
    x = x_buf[:, :k]  # rows strided, as a slice of a wider activation
    out_buf = torch.full((m, n + 16), 7.0, dtype=torch.bfloat16)
    out = out_buf[:, :n].fill_(float("nan"))

    ops.amx_linear(out, x, packed)

    assert_matches_linear(out, F.linear(x, w))
    assert torch.equal(out_buf[:, n:], torch.full((m, 16), 7.0, dtype=torch.bfloat16))


@needs_amx
@pytest.mark.parametrize("m", [32, 100])  # the two-pass decode loop, then the 2 x 2 loop
def test_amx_linear_is_the_same_on_any_number_of_threads(ops, m):
    """Threads take ranges of output columns from a shared queue in shrinking pieces (and the
    weight stream runs on into a thread's next range): every column is computed exactly once,
    whichever thread got it."""
    gen = torch.Generator().manual_seed(m)
    n, k = 4112, 96  # 257 column tiles: 129 chunks, the last one a single tile
    w = torch.randn(n, k, generator=gen).bfloat16()
    packed = ops.amx_pack_weight(w)
    x = torch.randn(m, k, generator=gen).bfloat16()
    outs = []
    for threads in (1, 2, 3):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        with num_threads(threads):
            ops.amx_linear(out, x, packed)
        outs.append(out)
    assert not outs[0].isnan().any(), "a column range was skipped"
    assert_matches_linear(outs[0], F.linear(x, w))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@needs_dense_linear
@pytest.mark.parametrize("body", ["amx", "avx512_bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("n,k", [(48, 64), (256, 96), (1040, 256)])  # 3, 16, 65 column tiles
@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 32, 33])
def test_dense_linear_matches_f_linear(ops, body, bias, m, n, k):
    """Both bodies of dense_linear on the same packed weight: F.linear's value (a rare one-ulp
    flip from summation order), strided rows in and out, nothing outside out written."""
    gen = torch.Generator().manual_seed(m * n + k + bias)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    packed = ops.amx_pack_weight(w)
    x = torch.randn(m, k + 32, generator=gen).bfloat16()[:, :k]
    out_buf = torch.full((m, n + 16), 7.0, dtype=torch.bfloat16)
    out = out_buf[:, :n].fill_(float("nan"))
    with dense_body(ops, body):
        ops.dense_linear(out, x, packed, b)
    assert_matches_linear(out, F.linear(x, w, b))
    assert torch.equal(out_buf[:, n:], torch.full((m, 16), 7.0, dtype=torch.bfloat16))


@needs_dense_linear
@pytest.mark.parametrize("body", ["amx", "avx512_bf16"])
def test_dense_linear_rows_do_not_depend_on_the_batch_or_the_threads(ops, body):
    """A row's bits are the same alone, among 37 rows and on 1, 2 or 3 threads: the property
    --batch-invariant builds on."""
    gen = torch.Generator().manual_seed(5)
    n, k = 1040, 192
    w = torch.randn(n, k, generator=gen).bfloat16()
    packed = ops.amx_pack_weight(w)
    x = torch.randn(37, k, generator=gen).bfloat16()
    with dense_body(ops, body):
        outs = []
        for threads in (1, 2, 3):
            out = torch.empty(37, n, dtype=torch.bfloat16)
            with num_threads(threads):
                ops.dense_linear(out, x, packed)
            outs.append(out)
        for i in (0, 5, 36):
            alone = torch.empty(1, n, dtype=torch.bfloat16)
            ops.dense_linear(alone, x[i : i + 1], packed)
            assert torch.equal(alone[0], outs[0][i]), i
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_dense_linear_refuses_what_the_packing_does_not_fit(ops):
    if not _dense_available():
        pytest.skip("no dense_linear here")
    packed = ops.amx_pack_weight(torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="shapes"):
        ops.dense_linear(torch.empty(2, 48, dtype=torch.bfloat16),
                         torch.zeros(2, 96, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bias"):
        ops.dense_linear(torch.empty(2, 48, dtype=torch.bfloat16),
                         torch.zeros(2, 64, dtype=torch.bfloat16), packed,
                         torch.zeros(32, dtype=torch.bfloat16))


def test_amx_pack_weight_rejects_unaligned_shapes(ops):
    with pytest.raises(RuntimeError, match="N % 16"):
        ops.amx_pack_weight(torch.zeros(40, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K % 32"):
        ops.amx_pack_weight(torch.zeros(48, 48, dtype=torch.bfloat16))


# ---- packed bf16 linears ------------------------------------------------------------------------
ROWS = [1, 5, AMX_MAX_ROWS, AMX_MAX_ROWS + 1, 96, 97, 300]  # decode sizes, then prefill sizes


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("n,k", [(96, 256), (40, 64)])  # 40: no AMX packing, oneDNN for all
def test_packed_linear_equals_f_linear(ops, bias, n, k):
    assert can_pack(torch.device("cpu"), torch.bfloat16), "oneDNN weight packing unavailable"
    gen = torch.Generator().manual_seed(n + bias)
    linear = nn.Linear(k, n, bias=bias).bfloat16()
    linear.weight.data = torch.randn(n, k, generator=gen).bfloat16()
    if bias:
        linear.bias.data = torch.randn(n, generator=gen).bfloat16()
    packed = PackedLinear(linear, ops)
    # dense_linear adds a bias in float32 before its one rounding, so it takes biased ones too.
    dense = _dense_available() and n % 16 == 0 and k % 32 == 0
    assert (packed.ops is not None) == dense, "dense_linear taken or skipped wrongly"
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            assert_matches_linear(packed(x), F.linear(x, linear.weight, linear.bias))
        x = torch.randn(4, 2 * k, generator=gen).bfloat16()[:, ::2]  # columns strided
        assert_matches_linear(packed(x), F.linear(x, linear.weight, linear.bias))


@needs_dense_linear
@pytest.mark.parametrize("body", ["amx", "avx512_bf16"])
def test_packed_linear_routes_narrow_outputs_to_amx_at_every_row_count(ops, body):
    """On AMX, up to AMX_NARROW_MAX_OUT outputs our kernel takes prefill-sized calls too; wider
    linears (and every linear on the vector body) take it only up to AMX_MAX_ROWS rows and leave
    the rest to oneDNN."""
    gen = torch.Generator().manual_seed(12)
    calls = []
    spy = _spy(ops, calls)
    narrow_rows = ROWS if body == "amx" else ROWS[:3]
    for n, amx_rows in ((AMX_NARROW_MAX_OUT, narrow_rows), (AMX_NARROW_MAX_OUT + 16, ROWS[:3])):
        linear = nn.Linear(64, n, bias=False).bfloat16()
        linear.weight.data = torch.randn(n, 64, generator=gen).bfloat16()
        with dense_body(ops, body):
            packed = PackedLinear(linear, spy)
        assert packed.kernel == body
        taken = []
        with torch.inference_mode():
            for rows in ROWS:
                calls.clear()
                x = torch.randn(rows, 64, generator=gen).bfloat16()
                assert_matches_linear(packed(x), F.linear(x, linear.weight))
                if "dense_linear" in calls:
                    taken.append(rows)
        assert taken == amx_rows, f"{n} outputs"


def test_packed_linear_runs_onednn_at_a_bounded_set_of_row_counts(monkeypatch):
    """oneDNN compiles and caches a kernel per row count: every length from 1 to 300 rows must
    reach it as one of a few padded row counts, each result still F.linear's."""
    gen = torch.Generator().manual_seed(21)
    linear = nn.Linear(64, 40, bias=True).bfloat16()  # no AMX packing: oneDNN for every size
    linear.weight.data = torch.randn(40, 64, generator=gen).bfloat16()
    linear.bias.data = torch.randn(40, generator=gen).bfloat16()
    packed = PackedLinear(linear, None)
    seen_rows = []
    onednn = cpu_linear.onednn_linear

    def spy(x, weight, bias):
        seen_rows.append(x.shape[0])
        return onednn(x, weight, bias)

    monkeypatch.setattr(cpu_linear, "onednn_linear", spy)
    with torch.inference_mode():
        for rows in range(1, 301):
            x = torch.randn(rows, 64, generator=gen).bfloat16()
            assert_matches_linear(packed(x), F.linear(x, linear.weight, linear.bias))
    assert len(seen_rows) == 300 and all(got >= rows for rows, got in enumerate(seen_rows, 1))
    assert len(set(seen_rows)) == 33, sorted(set(seen_rows))


def test_onednn_rows_pads_little_and_keeps_few_sizes_per_doubling():
    assert [onednn_rows(r) for r in range(1, ONEDNN_MIN_ROW_STEP + 1)] == list(
        range(1, ONEDNN_MIN_ROW_STEP + 1)
    )
    for rows in range(ONEDNN_MIN_ROW_STEP + 1, 8193):
        assert rows <= onednn_rows(rows) <= max(rows + ONEDNN_MIN_ROW_STEP - 1, rows * 9 / 8)
        assert onednn_rows(onednn_rows(rows)) == onednn_rows(rows)  # a padded size stays put
    for low in (128, 256, 512, 4096):
        assert len({onednn_rows(r) for r in range(low + 1, 2 * low + 1)}) == 8


def test_pack_linears_swaps_every_linear(ops):
    gen = torch.Generator().manual_seed(5)
    # 128 x 64 fits the AMX kernel; 40 x 128 (with a bias) stays on oneDNN for every size.
    model = nn.Sequential(
        nn.Linear(64, 128, bias=False), nn.Sequential(nn.SiLU(), nn.Linear(128, 40))
    ).bfloat16()
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=gen).bfloat16()
    xs = [torch.randn(rows, 64, generator=gen).bfloat16() for rows in (3, AMX_MAX_ROWS, 300)]
    with torch.inference_mode():
        want = [model(x) for x in xs]
    assert pack_linears(model, ops) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][1], PackedLinear)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert (model[0].ops is not None) == _dense_available() and model[1][1].ops is None
    with torch.inference_mode():
        for x, w in zip(xs, want):
            assert_matches_linear(model(x), w)


# ---- the model: kernels on against kernels off --------------------------------------------------
@pytest.fixture(scope="module")
def kernel_model_dir(tmp_path_factory):
    """head_dim 64 (the AVX-512 decode paths), GQA 2 over 2 KV heads, projections AMX-sized."""
    from conftest import build_tiny_model_dir

    return build_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-llama-d64"),
        seed=3,
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.05,
    )


def _load(model_dir, dtype, ops, monkeypatch):
    from transformers import AutoConfig

    import engine.runner.model_runner as model_runner

    monkeypatch.setattr(model_runner, "load_cpu_ops", lambda: ops)
    hf_config = AutoConfig.from_pretrained(model_dir)
    backend = TorchAttentionBackend() if ops is None else CpuAttentionBackend(ops)
    return model_runner.load_model(model_dir, hf_config, backend, dtype, torch.device("cpu"))


class PagedRun:
    """Drives a model step by step over its own paged cache with shuffled block tables."""

    def __init__(self, model, block_size: int, num_seqs: int, max_len: int, seed: int) -> None:
        attn = model.model.layers[0].self_attn
        per_seq = -(max_len // -block_size)
        num_blocks = num_seqs * per_seq + 2
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        dtype = model.model.embed_tokens.weight.dtype
        self.model, self.block_size = model, block_size
        self.kv = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in model.model.layers
        ]
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.table = perm[: num_seqs * per_seq].view(num_seqs, per_seq).to(torch.int32)
        self.computed = [0] * num_seqs
        self.fused_steps = 0  # steps the fused decode ran

    @torch.inference_mode()
    def step(self, new_tokens: list[list[int]], shared_blocks: int = 0, fused=None) -> torch.Tensor:
        """Appends new_tokens[i] to sequence i (none: not scheduled); logits of each last token.
        shared_blocks: leading block-table entries every decoding row has in common.
        fused: an engine.runner.fused_decode.FusedDecode that takes the steps it can run."""
        bs, ids, positions, slots, starts = self.block_size, [], [], [], [0]
        batch = [i for i, toks in enumerate(new_tokens) if toks]
        for i in batch:
            toks = new_tokens[i]
            pos = list(range(self.computed[i], self.computed[i] + len(toks)))
            ids += toks
            positions += pos
            slots += [int(self.table[i, p // bs]) * bs + p % bs for p in pos]
            starts.append(starts[-1] + len(toks))
            self.computed[i] += len(toks)
        query_lens = [len(new_tokens[i]) for i in batch]
        seq_lens = [self.computed[i] for i in batch]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=self.table[batch],
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            decode_shared_blocks=shared_blocks,
        )
        ids_t, pos_t = torch.tensor(ids), torch.tensor(positions)
        if fused is not None and fused.can_run(meta):
            self.fused_steps += 1
            hidden = fused.run(ids_t, pos_t, meta, self.kv)
        else:
            hidden = self.model(ids_t, pos_t, meta, self.kv)
        return self.model.compute_logits(hidden[[s - 1 for s in starts[1:]]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_model_logits_with_kernels_match_torch_ops(ops, kernel_model_dir, monkeypatch, dtype):
    """Prefill, decode steps (both AVX-512 decode paths) and a mixed step, kernels on vs off."""
    on = _load(kernel_model_dir, dtype, ops, monkeypatch)
    off = _load(kernel_model_dir, dtype, None, monkeypatch)
    assert on.model.norm.ops is ops and off.model.norm.ops is None
    if dtype == torch.bfloat16:  # packed linears either way; the AMX kernel only with ops
        assert isinstance(on.model.layers[0].mlp.down_proj.packed, PackedLinear)
        assert (on.model.layers[0].mlp.down_proj.packed.ops is not None) == _dense_available()
        assert off.model.layers[0].mlp.down_proj.packed.ops is None
    gen = torch.Generator().manual_seed(7)
    prompt_lens = [3, 16, 21, 40, 9]  # five sequences: the per-sequence decode path
    tokens = lambda n: torch.randint(3, 259, (n,), generator=gen).tolist()
    steps = [[tokens(n) for n in prompt_lens]]  # prefill
    steps += [[tokens(1) for _ in prompt_lens] for _ in range(2)]  # decode-only
    steps += [[[], tokens(1), [], tokens(1), []]]  # two decodes: the per-(seq, kv head) path
    steps += [[tokens(6)] + [tokens(1) for _ in prompt_lens[1:]]]  # a chunk among decodes
    runs = [PagedRun(m, 16, len(prompt_lens), 64, seed=4) for m in (on, off)]
    with num_threads(THREADS):
        for step in steps:
            got, want = (run.step(step) for run in runs)
            scale = want.abs().max().item()
            assert scale > 1.0, "degenerate logits"
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale)
            else:
                rel = ((got - want).norm() / want.norm()).item()
                assert rel < 2e-2, f"bf16 logits relative error {rel:.3g}"
                torch.testing.assert_close(got, want, rtol=0, atol=0.05 * scale)


def test_llm_greedy_tokens_kernels_on_equal_off(kernel_model_dir, ops, monkeypatch):
    """End to end through engine.llm.LLM in float32: the same greedy tokens either way."""
    from conftest import make_prompts

    import engine.runner.model_runner as model_runner
    import pagedserve_kernels.cpu_ops as cpu_ops
    from engine import LLM, SamplingParams

    prompts = make_prompts(5, seed=6, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for name, loaded in (("on", ops), ("off", None)):
        monkeypatch.setattr(model_runner, "load_cpu_ops", lambda loaded=loaded: loaded)
        monkeypatch.setattr(cpu_ops, "load_cpu_ops", lambda loaded=loaded: loaded)
        with num_threads(THREADS):
            llm = LLM(str(kernel_model_dir), dtype="float32")
            assert llm.engine.runner.model.model.norm.ops is loaded
            backend = llm.engine.runner.backend
            assert isinstance(backend, CpuAttentionBackend) == (loaded is not None)
            assert loaded is None or backend.ops is loaded
            res = llm.generate(prompts, params, use_tqdm=False)
        outs[name] = [o.outputs[0].token_ids for o in res]
    assert all(len(t) == 6 for t in outs["on"])
    assert outs["on"] == outs["off"]


def test_rope_frequencies_stay_float32_when_the_model_is_cast():
    rope = RotaryEmbedding(64, 10000.0)
    want = rope.inv_freq.clone()
    rope = rope.to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rope.inv_freq, want, rtol=0, atol=0)
    cache = rope.cos_sin_cache(1001, torch.bfloat16)
    angle = 1000 * want[1]  # position 1000, second frequency, from float32 frequencies
    assert abs(cache[1000, 1].float().item() - torch.cos(angle).item()) < 1e-2


def test_index_arrays_out_of_range_are_refused(ops):
    q = torch.randn(3, 4, 64)
    k = torch.randn(3, 2, 64)
    cache = torch.randn(8, 64)
    for bad in ([0, 8, 1], [0, -1, 1]):  # past the cache, negative
        with pytest.raises(RuntimeError, match="position outside the cache"):
            ops.rotary_embedding(torch.tensor(bad), q, k, cache)
    k_cache = torch.randn(4, 16, 2, 64)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    out = torch.empty(2, 4, 64)
    for bad in ([5, 33], [0, 7]):  # longer than two blocks of 16, empty
        with pytest.raises(RuntimeError, match="seq_lens must be in"):
            ops.paged_attention_decode(
                out,
                torch.randn(2, 4, 64),
                k_cache,
                k_cache,
                table,
                torch.tensor(bad, dtype=torch.int32),
                0.125,
            )


# ---- paged prefill attention (AMX) --------------------------------------------------------------
# (block_size, num_heads, num_kv_heads, head_dim, [(query length, context length), ...]):
# whole prompts (q == kv), chunks after a cached prefix or an earlier chunk (q < kv), single-token
# rows, query blocks of 16 with tails, lengths on and off block boundaries.
PREFILL_CASES = [
    (16, 9, 3, 64, [(256, 256), (17, 17), (1, 9), (40, 100)]),  # SmolLM2's shapes
    (16, 8, 2, 64, [(128, 640), (5, 5), (16, 16), (33, 48)]),  # prefix hit, GQA 4
    (32, 10, 2, 128, [(31, 31), (64, 95), (2, 2)]),  # GQA 5, head_dim 128, block 32
    (16, 4, 4, 64, [(19, 19), (3, 70)]),  # MHA
    (16, 16, 1, 128, [(48, 300), (7, 7)]),  # MQA, 16 query heads per KV head
    (16, 8, 2, 96, [(128, 640), (5, 5), (17, 17), (33, 48)]),  # Phi-3's head_dim 96, GQA 4
    (16, 6, 6, 96, [(100, 100), (3, 70), (1, 1)]),  # MHA as Phi-3-mini
    (32, 10, 2, 160, [(31, 31), (64, 95), (2, 2)]),  # an odd number of 32-dim chunks (5)
    (16, 6, 3, 192, [(40, 100), (1, 9)]),
    (16, 4, 1, 224, [(20, 50), (16, 16)]),  # 7 chunks
]


def _prefill_id(case) -> str:
    bs, h, hkv, d, seqs = case
    return f"bs{bs}-h{h}/{hkv}-d{d}-" + "-".join(f"{q}of{kv}" for q, kv in seqs)


def varlen_meta(q_lens, kv_lens, block_table) -> AttentionMetadata:
    """Sequences with q_lens new tokens each, back to back, over kv_lens of context."""
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        query_start_loc=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_table=block_table,
        query_lens_cpu=q_lens,
        seq_lens_cpu=kv_lens,
        max_query_len=max(q_lens),
        max_seq_len=max(kv_lens),
    )


@needs_prefill_kernel
@pytest.mark.parametrize("body", PREFILL_BODIES)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=_prefill_id)
def test_paged_prefill_matches_per_sequence_reference(ops, case, body):
    block_size, heads, kv_heads, head_dim, seqs = case
    gen = torch.Generator().manual_seed(len(seqs) * head_dim + heads)
    q_lens, kv_lens = [q for q, _ in seqs], [kv for _, kv in seqs]
    k_cache, v_cache, block_table = make_paged(
        block_size, kv_heads, head_dim, kv_lens, torch.bfloat16, gen
    )
    # query rows as the model hands them over: q out of a fused qkv row, sequences back to back
    # after one decode row that the kernel must leave alone.
    rows = 1 + sum(q_lens)
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=gen).bfloat16()
    query = qkv[:, :heads]
    out = torch.full((rows, heads, head_dim), float("nan"), dtype=torch.bfloat16)
    q_start = torch.tensor([1 + sum(q_lens[:i]) for i in range(len(seqs))], dtype=torch.int32)
    scale = head_dim**-0.5
    with num_threads(THREADS), prefill_body(ops, body):
        q_len_t, kv_len_t = (torch.tensor(v, dtype=torch.int32) for v in (q_lens, kv_lens))
        ops.paged_attention_prefill(
            out, query, k_cache, v_cache, block_table, q_start, q_len_t, kv_len_t, scale
        )
    assert out[0].isnan().all(), "a row outside every sequence was written"
    meta = varlen_meta(q_lens, kv_lens, block_table)
    want = paged_attention(query[1:].float(), k_cache.float(), v_cache.float(), meta, scale)
    got = out[1:].float()
    assert not got.isnan().any(), "unwritten or NaN-contaminated output"
    # probabilities are rounded to bf16 before P x V (as in flash attention): a few bf16 ulps
    torch.testing.assert_close(got, want, rtol=ULP[torch.bfloat16], atol=8e-3)
    assert (got - want).abs().mean() < 4e-3 * want.abs().mean(), "beyond bf16 rounding on average"


@needs_prefill_kernel
def test_paged_prefill_refuses_bad_lengths(ops):
    k_cache, v_cache, block_table = make_paged(16, 1, 64, [20], torch.bfloat16, torch.Generator())
    query = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    good = (i32(0), i32(4), i32(20))
    ops.paged_attention_prefill(out, query, k_cache, v_cache, block_table, *good, 0.125)
    for bad in [
        (i32(1), i32(4), i32(20)),  # rows past the end of query
        (i32(0), i32(4), i32(3)),  # more queries than context
        (i32(0), i32(0), i32(20)),  # no query
        (i32(0), i32(4), i32(49)),
    ]:  # context beyond the block table (3 blocks of 16)
        with pytest.raises(RuntimeError):
            ops.paged_attention_prefill(out, query, k_cache, v_cache, block_table, *bad, 0.125)


@needs_prefill_kernel
def test_torch_backend_routes_bf16_prefill_through_the_kernel(ops):
    """Mixed batches in bf16: prefills go to the prefill kernel in one call per layer, decodes to
    the decode kernel, and the result matches the kernel-free backend within bf16 rounding; the
    kernel's arguments, built once per step, follow the next step's batch."""
    kv_lens = [30, 20, 5, 60]
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, block_table = make_paged(16, 3, 64, kv_lens, torch.bfloat16, gen)
    k_cache, v_cache = k_cache.nan_to_num(0), v_cache.nan_to_num(0)
    calls = []

    class Spy:
        def __getattr__(self, name):
            fn = getattr(ops, name)
            return lambda *args: (calls.append(name), fn(*args))[1]

    backend = CpuAttentionBackend(Spy())
    for q_lens in ([1, 20, 1, 37], [1, 20, 1, 37], [12, 1, 5, 1]):  # layer 1, layer 2, next step
        meta = varlen_meta(q_lens, kv_lens, block_table)
        query = torch.randn(sum(q_lens), 9, 64, generator=gen).bfloat16()
        calls.clear()
        got = backend.forward(query, k_cache, v_cache, meta, 0.125)
        want = TorchAttentionBackend().forward(query, k_cache, v_cache, meta, 0.125)
        assert calls.count("paged_attention_prefill") == 1
        assert calls.count("paged_attention_decode") == 1
        torch.testing.assert_close(got.float(), want.float(), rtol=ULP[torch.bfloat16], atol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_backend_takes_the_fast_kernels_at_phi3_head_dim_96(ops, dtype):
    """Phi-3-mini's head shape (MHA, head_dim 96): in bf16 with AMX the decode rows run the AMX
    decode kernel and the prefills the AMX prefill kernel, as Llama's head_dim 64 and 128 do;
    in float32 (or without AMX) the decode rows run the AVX-512 register kernels, never the
    portable loop. The result matches the kernel-free backend."""
    kv_lens = [30, 20, 5, 60, 17]
    gen = torch.Generator().manual_seed(12)
    k_cache, v_cache, block_table = make_paged(16, 6, 96, kv_lens, dtype, gen)
    k_cache, v_cache = k_cache.nan_to_num(0), v_cache.nan_to_num(0)
    q_lens = [1, 20, 1, 37, 1]
    meta = varlen_meta(q_lens, kv_lens, block_table)
    query = torch.randn(sum(q_lens), 6, 96, generator=gen).to(dtype)
    calls = []
    backend = CpuAttentionBackend(_spy(ops, calls))
    with num_threads(THREADS):
        got = backend.forward(query, k_cache, v_cache, meta, 96**-0.5)
        decode_rows = query[[0, 21, 59]]
        kernel = ops.decode_kernel(decode_rows, k_cache)
        batch_kernel = ops.decode_kernel(query[:8], k_cache)  # 8 sequences: one task each
    want = TorchAttentionBackend().forward(query, k_cache, v_cache, meta, 96**-0.5)
    amx = dtype == torch.bfloat16 and _amx_available()
    assert calls.count("paged_attention_decode") == 1
    kernel_prefill = dtype == torch.bfloat16 and _prefill_available()
    assert calls.count("paged_attention_prefill") == int(kernel_prefill)
    assert backend.prefill_shapes_supported(96, 16) == _prefill_available()
    assert kernel == ("amx" if amx else "avx512_head"), kernel
    assert batch_kernel == ("amx" if amx else "avx512_seq"), batch_kernel
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=8e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


# ---- cascade decode: a shared prefix read once for all sequences (AMX) -------------------------
# (block_size, num_heads, num_kv_heads, head_dim, prefix_len, suffix lengths): B x G queries per KV
# head in 16s with a tail, suffixes on and off block boundaries, a prefix ending inside a block.
CASCADE_CASES = [
    (16, 9, 3, 64, 512, [1 + 7 * i for i in range(30)]),  # SmolLM2's shapes: 90 = 5 x 16 + 10
    (16, 16, 1, 64, 64, [3, 16, 17]),  # 16 query heads per KV head: one full tile per sequence
    (32, 10, 2, 128, 96, [33, 1, 64, 95, 2, 40, 31, 7, 32]),  # GQA 5, head_dim 128, block 32
    (16, 4, 4, 64, 40, [1] * 17),  # MHA, a 40-token prefix (2.5 blocks), one-token suffixes
    (16, 4, 1, 256, 64, [3, 16, 17, 40, 9]),  # Gemma 3's head_dim 256 on one KV head
    (16, 8, 2, 96, 128, [3, 16, 17, 40, 9, 1, 33, 64]),  # Phi-3's head_dim 96, GQA 4
    (16, 4, 4, 96, 40, [1] * 17),  # MHA as Phi-3-mini
    (16, 10, 2, 160, 80, [5, 20, 31]),  # 5 chunks of 32 dims, GQA 5
]


def _cascade_id(case) -> str:
    bs, h, hkv, d, prefix, lens = case
    return f"bs{bs}-h{h}/{hkv}-d{d}-p{prefix}-b{len(lens)}"


def make_cascade(case, gen):
    """Caches holding one shared prefix and every sequence's own suffix blocks, scattered, with
    NaN in every slot nobody owns; the query is a strided view, as q out of a fused qkv."""
    block_size, heads, kv_heads, head_dim, prefix_len, suffix_lens = case
    prefix_blocks = -(prefix_len // -block_size)
    k_cache, v_cache, table = make_paged(
        block_size, kv_heads, head_dim, [prefix_len] + suffix_lens, torch.bfloat16, gen
    )
    query = torch.randn(len(suffix_lens), heads + 2 * kv_heads, head_dim, generator=gen)
    query = query.bfloat16()[:, :heads]
    return k_cache, v_cache, table[0, :prefix_blocks].contiguous(), table[1:], query


def cascade_reference(query, k_cache, v_cache, prefix, prefix_len, table, suffix_lens, scale):
    """float32 attention of each query over the prefix's tokens followed by its own."""
    out = []
    for i, n in enumerate(suffix_lens):
        keys = [
            torch.cat([gather_kv(c, prefix, prefix_len), gather_kv(c, table[i], n)]).float()
            for c in (k_cache, v_cache)
        ]
        q = query[i].float()[None, :, None]  # [1, H, 1, D]
        k, v = (t.transpose(0, 1)[None] for t in keys)  # [1, Hkv, L, D]
        o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        out.append(o[0, :, 0])
    return torch.stack(out)


@needs_prefill_kernel
@pytest.mark.parametrize("body", PREFILL_BODIES)
@pytest.mark.parametrize("case", CASCADE_CASES, ids=_cascade_id)
def test_paged_attention_cascade_matches_reference(ops, case, body):
    """Within the AMX decode kernel's bounds: numerators rounded to bf16 in each part, the
    parts merged by log-sum-exp in float32 and rounded once; on AMX and on the vector body
    (the prefill kernel's block for the suffixes too)."""
    prefix_len, suffix_lens, head_dim = case[4], case[5], case[3]
    k_cache, v_cache, prefix, table, query = make_cascade(case, torch.Generator().manual_seed(5))
    out_buf = torch.full((len(suffix_lens), query.shape[1], head_dim + 8), 7.0).bfloat16()
    out = out_buf[..., :head_dim].fill_(float("nan"))
    lens = torch.tensor(suffix_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    with num_threads(THREADS), prefill_body(ops, body):
        ops.paged_attention_cascade(
            out, query, k_cache, v_cache, prefix, prefix_len, table, lens, scale
        )
    assert (out_buf[..., head_dim:] == 7.0).all(), "written past the head's dims"
    want = cascade_reference(query, k_cache, v_cache, prefix, prefix_len, table, suffix_lens, scale)
    got = out.float()
    assert not got.isnan().any(), "unwritten or NaN-contaminated output"
    torch.testing.assert_close(got, want, rtol=ULP[torch.bfloat16], atol=4e-3)
    assert (got - want).abs().mean().item() < 5e-4, "beyond bf16 rounding on average"


@needs_prefill_kernel
def test_paged_attention_cascade_refuses_bad_arguments(ops):
    case = (16, 4, 2, 64, 32, [5, 20])
    k_cache, v_cache, prefix, table, query = make_cascade(case, torch.Generator().manual_seed(6))
    out = torch.empty(query.shape, dtype=torch.bfloat16)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    good = dict(prefix=prefix, prefix_len=32, lens=i32(5, 20))
    bad = [
        dict(good, prefix_len=0),  # no prefix
        dict(good, prefix_len=33),  # longer than its two blocks
        dict(good, lens=i32(5, 0)),  # a sequence with no suffix token
        dict(good, lens=i32(5, 49)),  # beyond the table's three columns of 16
        dict(good, prefix=i32(0, k_cache.shape[0])),  # a block past the cache
    ]

    def call(prefix, prefix_len, lens, q=query, k=k_cache):
        ops.paged_attention_cascade(out, q, k, v_cache, prefix, prefix_len, table, lens, 0.125)

    call(**good)
    for args in bad:
        with pytest.raises(RuntimeError):
            call(**args)
    with pytest.raises(RuntimeError, match="bf16 only"):
        call(**good, q=query.float())


@needs_prefill_kernel
@pytest.mark.parametrize("head_dim", [64, 96])
def test_torch_backend_routes_shared_prefix_decodes_through_the_cascade(ops, head_dim):
    """Decoding sequences with decode_shared_blocks set go to the cascade kernel (alone, or
    beside prefills in a mixed batch) once there are CASCADE_MIN_SEQS of them sharing at least
    CASCADE_MIN_TOKENS; the result matches the kernel-free backend within bf16 rounding.
    head_dim 96 (Phi-3) takes the same kernels as 64."""
    import pagedserve_kernels.cpu_backend as cpu_backend

    n_seq, bs = cpu_backend.CASCADE_MIN_SEQS, 16
    shared = cpu_backend.CASCADE_MIN_TOKENS // bs
    case = (bs, 9, 3, head_dim, shared * bs, [3 + 5 * i for i in range(n_seq + 1)])
    k_cache, v_cache, prefix, suffix_table, _ = make_cascade(case, torch.Generator().manual_seed(8))
    k_cache, v_cache = k_cache.nan_to_num(0), v_cache.nan_to_num(0)
    table = torch.cat([prefix.expand(n_seq + 1, -1), suffix_table], dim=1)
    kv_lens = [shared * bs + n for n in case[5]]
    gen = torch.Generator().manual_seed(9)
    calls = []
    backend = CpuAttentionBackend(_spy(ops, calls))
    cascade, decode, prefill = (f"paged_attention_{k}" for k in ("cascade", "decode", "prefill"))
    runs = [  # (query lengths, shared blocks, expected kernel calls)
        ([1] * (n_seq + 1), shared, [cascade]),
        ([20] + [1] * n_seq, shared, [prefill, cascade]),
        ([1] * (n_seq + 1), shared - 1, [decode]),  # prefix too short
        ([20, 20] + [1] * (n_seq - 1), shared, [prefill, decode]),  # too few decoding
    ]
    for q_lens, shared_blocks, expected in runs:
        meta = varlen_meta(q_lens, kv_lens, table)
        meta.decode_shared_blocks = shared_blocks
        query = torch.randn(sum(q_lens), 9, head_dim, generator=gen).bfloat16()
        calls.clear()
        scale = head_dim**-0.5
        got = backend.forward(query, k_cache, v_cache, meta, scale)
        want = TorchAttentionBackend().forward(query, k_cache, v_cache, meta, scale)
        assert [c for c in calls if c.startswith("paged_attention")] == expected
        torch.testing.assert_close(got.float(), want.float(), rtol=ULP[torch.bfloat16], atol=8e-3)


@needs_prefill_kernel
def test_llm_shared_prefix_decodes_take_the_cascade_and_keep_greedy_tokens(
    kernel_model_dir, ops, monkeypatch
):
    """End to end in bf16: prompts sharing a prefix-cached 160-token start decode through the
    cascade kernel, and the greedy tokens match those with the cascade switched off."""
    from conftest import make_prompts

    import engine.runner.model_runner as model_runner
    import pagedserve_kernels.cpu_backend as cpu_backend
    import pagedserve_kernels.cpu_ops as cpu_ops
    from engine import LLM, SamplingParams

    monkeypatch.setattr(cpu_backend, "FUSED_DECODE_MAX_ROWS", 0)  # layer by layer: spy sees it
    prefix = make_prompts(1, seed=11, min_len=160, max_len=160)[0]
    prompts = [prefix + tail for tail in make_prompts(10, seed=12, max_len=20)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    calls = []
    spy = _spy(ops, calls)
    monkeypatch.setattr(model_runner, "load_cpu_ops", lambda: spy)
    monkeypatch.setattr(cpu_ops, "load_cpu_ops", lambda: spy)
    outs = {}
    for name, min_tokens in (("on", cpu_backend.CASCADE_MIN_TOKENS), ("off", 10**9)):
        monkeypatch.setattr(cpu_backend, "CASCADE_MIN_TOKENS", min_tokens)
        calls.clear()
        with num_threads(THREADS):
            llm = LLM(str(kernel_model_dir), dtype="bfloat16")
            llm.generate([prefix + [7]], params, use_tqdm=False)  # the prefix, cached
            res = llm.generate(prompts, params, use_tqdm=False)
        outs[name] = [o.outputs[0].token_ids for o in res]
        outs[name + "_calls"] = calls.count("paged_attention_cascade")
    assert outs["on_calls"] > 0 and outs["off_calls"] == 0
    assert all(len(t) == 8 for t in outs["on"])
    # bf16 rounding differs between the two paths, so a near-tie late in a sequence may flip:
    # all but one sequence agree token for token, and every one for its first 3 decode steps.
    same = sum(a == b for a, b in zip(outs["on"], outs["off"]))
    assert same >= len(prompts) - 1, (outs["on"], outs["off"])
    assert all(a[:4] == b[:4] for a, b in zip(outs["on"], outs["off"]))


# ---- a decode step through every layer in one call ----------------------------------------------
@needs_dense_linear
@pytest.mark.parametrize("shared", [False, True], ids=["decode", "cascade"])
def test_fused_decode_step_is_bit_identical_to_the_layer_by_layer_path(
    ops, kernel_model_dir, monkeypatch, shared
):
    """ops.decode_layers (FusedDecode) calls the kernels the layers call, in the same order:
    same logits and same K/V caches to the bit, with the decode kernel and with the cascade over
    a shared prefix (10 sequences whose first 9 blocks are the same 144 tokens)."""
    from engine.runner.fused_decode import FusedDecode


    model = _load(kernel_model_dir, torch.bfloat16, ops, monkeypatch)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norm weights load as ones: make each layer's two norms differ
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
    backend = model.model.layers[0].self_attn.attn.backend
    fused = FusedDecode.build(model, backend)
    assert fused is not None, "the fused path does not apply"
    tokens = lambda n: torch.randint(3, 259, (n,), generator=gen).tolist()
    num_seqs, prefix_blocks = 10, 9
    prefix = tokens(prefix_blocks * 16) if shared else []
    steps = [[prefix + tokens(5 + 3 * i) for i in range(num_seqs)]]
    steps += [[tokens(1) for _ in range(num_seqs)] for _ in range(3)]
    runs = [PagedRun(model, 16, num_seqs, 256, seed=6) for _ in range(2)]
    if shared:
        for run in runs:
            run.table[:, :prefix_blocks] = run.table[0, :prefix_blocks]
    shared_blocks = prefix_blocks if shared else 0
    plans = []
    real_plan = backend.cascade_plan

    def plan_spy(*args):
        plan = real_plan(*args)
        plans.append(plan is not None)
        return plan

    monkeypatch.setattr(backend, "cascade_plan", plan_spy)
    with num_threads(THREADS):
        for i, step in enumerate(steps):
            outs = []
            for run, step_fused in zip(runs, (fused, None)):  # None: layer by layer
                outs.append(run.step(step, shared_blocks if i else 0, step_fused))
            assert torch.equal(outs[0], outs[1]), f"step {i}: logits differ"
            for (k0, v0), (k1, v1) in zip(runs[0].kv, runs[1].kv):
                assert torch.equal(k0, k1) and torch.equal(v0, v1), f"step {i}: caches differ"
    assert runs[0].fused_steps == len(steps) - 1 and runs[1].fused_steps == 0
    assert plans and all(p == shared for p in plans), "cascade taken where it should not be"


@needs_dense_linear
def test_llm_decode_steps_run_fused_with_the_tokens_of_the_layer_by_layer_path(
    kernel_model_dir, ops, monkeypatch
):
    """In the engine, decode-only steps go through ops.decode_layers (prefill and mixed steps
    layer by layer), and greedy tokens are those of the layer-by-layer path exactly."""
    from conftest import make_prompts

    import engine.runner.model_runner as model_runner
    import pagedserve_kernels.cpu_backend as cpu_backend
    import pagedserve_kernels.cpu_ops as cpu_ops
    from engine import LLM, SamplingParams

    prefix = make_prompts(1, seed=21, min_len=160, max_len=160)[0]
    prompts = [prefix + tail for tail in make_prompts(9, seed=22, max_len=20)]
    prompts += make_prompts(4, seed=23, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    calls = []
    monkeypatch.setattr(model_runner, "load_cpu_ops", lambda: _spy(ops, calls))
    monkeypatch.setattr(cpu_ops, "load_cpu_ops", lambda: _spy(ops, calls))
    outs = {}
    for name, max_rows in (("fused", cpu_backend.FUSED_DECODE_MAX_ROWS), ("layers", 0)):
        monkeypatch.setattr(cpu_backend, "FUSED_DECODE_MAX_ROWS", max_rows)
        calls.clear()
        with num_threads(THREADS):
            llm = LLM(str(kernel_model_dir), dtype="bfloat16")
            llm.generate([prefix + [7]], params, use_tqdm=False)
            res = llm.generate(prompts, params, use_tqdm=False)
        outs[name] = [o.outputs[0].token_ids for o in res]
        outs[name + "_calls"] = calls.count("decode_layers")
    assert outs["fused_calls"] > 0 and outs["layers_calls"] == 0
    assert all(len(t) == 10 for t in outs["fused"])
    assert outs["fused"] == outs["layers"]


# ---- argmax (greedy sampling) -------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [1, 7, 16, 37, 49152])
def test_argmax_rows_matches_torch_argmax(ops, vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab + 5, generator=gen)[:, :vocab]  # rows strided, columns contiguous
    x[1] = 0.5  # all equal: the first index
    x[2, -1] = 50.0  # the maximum in the last column (a tail past whole vectors when vocab % 16)
    x[3] = float("-inf")
    if vocab > 3:
        x[4, 2] = x[4, vocab - 1] = 60.0  # tie between a vector lane and the tail: first wins
        x[5, vocab // 2] = float("nan")  # NaN counts as the largest, as in torch.argmax
        x[6, 1] = x[6, vocab - 2] = float("nan")
        x[7, 0] = float("inf")
    if vocab > 32:
        x[8, 17] = x[8, 32] = 70.0  # tie across vector lanes: lane 1 holds 17, lane 0 holds 32
    got = ops.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))


def test_build_key_changes_with_every_source_and_header(tmp_path):
    """Editing any one .cpp or .h of pagedserve_kernels/csrc/ moves the build to a new directory (a
    rebuild), and so does adding a file; a copy of the folder elsewhere builds in a directory of its
    own (ninja rebuilds whenever a source's path changes, so two checkouts must not share one)."""
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    files = sorted([*csrc.glob("*.cpp"), *csrc.glob("*.h")])
    assert {path.suffix for path in files} == {".cpp", ".h"}
    base = build_key(csrc)
    assert base != build_key(CSRC)
    keys = {base, build_key(CSRC)}
    for path in files:
        text = path.read_bytes()
        path.write_bytes(text + b"\n// edited\n")
        keys.add(build_key(csrc))
        path.write_bytes(text)
        assert build_key(csrc) == base
    assert len(keys) == len(files) + 2, "some file's edit left the build key unchanged"
    (csrc / "new_family.cpp").write_text("// a kernel family added later\n")
    assert build_key(csrc) not in keys


def test_build_compiles_every_source():
    """Each family's .cpp is a translation unit of the extension, the registration file too."""
    names = [path.name for path in sources()]
    assert names == sorted(path.name for path in CSRC.glob("*.cpp"))
    assert "registration.cpp" in names and len(names) > 1


def _package_data(package: str) -> list[str]:
    """The `package = [...]` line of pyproject's [tool.setuptools.package-data] (no tomllib on
    Python 3.10)."""
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.package-data]\n", 1)[1].split("\n[", 1)[0]
    for line in section.splitlines():
        name, _, value = line.partition("=")
        if name.strip() == package:
            return ast.literal_eval(value.split("#", 1)[0].strip())
    raise AssertionError(f"no package-data for {package!r} in pyproject.toml")


def test_package_ships_every_source_and_header():
    """pyproject's package-data covers every file the build reads, headers included."""
    patterns = _package_data("pagedserve_kernels")
    needed = [f"csrc/{path.name}" for path in [*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]]
    assert any(name.endswith(".h") for name in needed)
    missing = [name for name in needed if not any(fnmatch.fnmatch(name, p) for p in patterns)]
    assert not missing, f"not in [tool.setuptools.package-data] kernels: {missing}"


def test_build_lock_clears_a_dead_builds_lock_and_admits_one_builder_at_a_time(tmp_path):
    """A build killed half way leaves torch's `lock` file behind; the next start must not wait on
    it forever. While one process holds the build lock, another cannot take it."""
    import subprocess
    import sys

    from pagedserve_kernels.cpu_ops import build_lock

    (tmp_path / "lock").write_text("left by a build that was killed")
    probe = (
        "import fcntl, sys\n"
        f"h = open({str(tmp_path / '.build.flock')!r}, 'w')\n"
        "try:\n    fcntl.flock(h, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n"
        "    sys.exit(3)\n"
    )
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        held = subprocess.run([sys.executable, "-c", probe], timeout=60)
        assert held.returncode == 3, "a second builder got the lock while the first held it"
    free = subprocess.run([sys.executable, "-c", probe], timeout=60)
    assert free.returncode == 0


# ---- sliding windows and logit soft-capping -----------------------------------------------------
# Against the dense definition in tests/window_attention.py; the blocks behind each window are
# placeholders full of NaN and inf, so a kernel that reads them fails.
# (block_size, num_heads, num_kv_heads, head_dim, seq_lens, window, softcap), one query each:
DECODE_WINDOW_CASES = [
    (16, 4, 1, 256, [4096, 600, 513, 512], 512, 0.0),  # Gemma 3 270M, one task per sequence
    (16, 4, 1, 256, [700, 37], 512, 50.0),  # per (sequence, KV head), W > one context
    (16, 8, 2, 64, [40, 8, 16, 17, 100, 33], 8, 30.0),  # W on and off block boundaries
    (16, 8, 2, 128, [70, 33, 1], 16, 0.0),  # W = block size
    (8, 9, 3, 128, [29, 64, 12, 7, 90], 13, 20.0),  # blocks of 8: no AMX
    (16, 6, 2, 80, [50, 20, 3], 21, 10.0),  # head_dim 80: registers, one KV head per task
    (16, 6, 2, 48, [50, 20, 3], 21, 10.0),  # head_dim 48: the portable loop
    (16, 8, 2, 96, [40, 8, 16, 17, 100, 33], 8, 30.0),  # Phi-3's head_dim 96
    (16, 4, 4, 96, [700, 37], 512, 0.0),
    (16, 4, 4, 64, [50, 20, 3, 9], 0, 30.0),  # softcap alone
    (16, 4, 2, 64, [1, 2, 33], 1, 0.0),  # W = 1: the query's own key only
]


def _window_decode_id(c) -> str:
    return f"bs{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-b{len(c[4])}-w{c[5]}-c{c[6]:g}"


def _decode_window_inputs(case, dtype, seed=0):
    block_size, heads, kv_heads, head_dim, seq_lens, window, softcap = case
    full = (block_size, heads, kv_heads, head_dim, [1] * len(seq_lens), seq_lens, window, softcap)
    return window_inputs(full, seed=seed, dtype=dtype)


@pytest.mark.parametrize("path", ["float32", "bfloat16", "bfloat16-amx"])
@pytest.mark.parametrize("case", DECODE_WINDOW_CASES, ids=_window_decode_id)
def test_paged_decode_window_softcap_matches_definition(ops, case, path):
    dtype = torch.float32 if path == "float32" else torch.bfloat16
    amx = path.endswith("amx")
    if amx and not _amx_available():
        pytest.skip("no AMX here")
    q, k_cache, v_cache, meta, scale, window, softcap, want, skipped = _decode_window_inputs(
        case, dtype
    )
    assert window == 0 or window >= max(meta.seq_lens_cpu) or any(skipped)
    out = torch.full_like(q, float("nan"))
    with num_threads(THREADS), amx_decode(ops, amx):
        ops.paged_attention_decode(
            out, q, k_cache, v_cache, meta.block_table, meta.seq_lens, scale, window, softcap
        )
    assert not out.isnan().any(), "unwritten output, or a read behind the window"
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    elif not amx:  # float32 inside, one rounding of the output
        torch.testing.assert_close(out.double(), want, rtol=ULP[torch.bfloat16], atol=1e-3)
    else:  # AMX rounds the numerators to bf16 (flash attention's rounding): a few ulps
        torch.testing.assert_close(out.double(), want, rtol=ULP[torch.bfloat16], atol=8e-3)
        err = (out.double() - want).abs().mean()
        assert err < 4e-3 * want.abs().mean(), "beyond bf16 rounding on average"


# (block_size, num_heads, num_kv_heads, head_dim, query_lens, seq_lens, window, softcap)
PREFILL_WINDOW_CASES = [
    (16, 4, 1, 256, [512, 100, 37], [2048, 700, 37], 512, 0.0),  # Gemma 3 270M's shapes
    (16, 8, 2, 64, [20, 9, 33, 1], [70, 60, 33, 5], 16, 0.0),  # W = block, a whole prompt
    (32, 10, 2, 128, [31, 20, 2], [31, 95, 80], 24, 20.0),  # block 32, window and softcap
    (16, 9, 3, 64, [17, 48], [17, 300], 0, 30.0),  # softcap alone
    (16, 4, 4, 64, [20, 5], [20, 47], 1, 0.0),  # W = 1
    (16, 4, 1, 256, [70, 1], [333, 90], 45, 50.0),  # W mid-block, head_dim 256
    (16, 8, 2, 96, [20, 9, 33, 1], [70, 60, 33, 5], 16, 30.0),  # head_dim 96, window and cap
]


@needs_prefill_kernel
@pytest.mark.parametrize("body", PREFILL_BODIES)
@pytest.mark.parametrize(
    "case", PREFILL_WINDOW_CASES, ids=lambda c: _window_decode_id(c[:4] + c[5:])
)
def test_paged_prefill_window_softcap_matches_definition(ops, case, body):
    q, k_cache, v_cache, meta, scale, window, softcap, want, skipped = window_inputs(
        case, seed=3, dtype=torch.bfloat16
    )
    assert window == 0 or any(skipped)
    out = torch.full_like(q, float("nan"))
    q_lens = torch.tensor(meta.query_lens_cpu, dtype=torch.int32)
    with num_threads(THREADS), prefill_body(ops, body):
        ops.paged_attention_prefill(
            out, q, k_cache, v_cache, meta.block_table, meta.query_start_loc[:-1].contiguous(),
            q_lens, meta.seq_lens, scale, window, softcap,
        )
    assert not out.isnan().any(), "unwritten output, or a read behind the window"
    torch.testing.assert_close(out.double(), want, rtol=ULP[torch.bfloat16], atol=8e-3)
    assert (out.double() - want).abs().mean() < 4e-3 * want.abs().mean(), "beyond bf16 rounding"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_runs_windowed_soft_capped_layers_on_the_kernels(ops, dtype):
    """Mixed batches with a window and a cap: decodes go to the decode kernel, bf16 prefills to
    the prefill kernel where AMX is (float32 prefills to the reference), never the cascade."""
    case = (16, 4, 1, 256, [1, 40, 1, 200, 1], [700, 300, 90, 200, 513], 128, 50.0)
    q, k_cache, v_cache, meta, scale, window, softcap, want, _ = window_inputs(case, dtype=dtype)
    meta.decode_shared_blocks = 2  # a shared prefix would take the cascade without the window
    calls = []
    backend = CpuAttentionBackend(_spy(ops, calls))
    got = backend.forward(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    prefill_calls = 1 if dtype == torch.bfloat16 and _prefill_available() else 0
    assert calls.count("paged_attention_decode") == 1
    assert calls.count("paged_attention_prefill") == prefill_calls
    assert calls.count("paged_attention_cascade") == 0
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=8e-3)
    torch.testing.assert_close(got.double(), want, **tol)


@needs_prefill_kernel
def test_head_dim_256_prefill_takes_the_kernel_only_while_its_keys_are_few(ops):
    """Gemma's head_dim 256: windowed layers and short contexts on the AMX prefill kernel, long
    full-attention contexts on SDPA (faster there: cpu_backend.PREFILL_D256_MAX_KEYS)."""
    long = PREFILL_D256_MAX_KEYS + 100
    for window, ctx, kernel in ((512, long, True), (0, long, False), (0, 300, True)):
        case = (16, 4, 1, 256, [64, 1], [ctx, 90], window, 0.0)
        q, k_cache, v_cache, meta, scale, _, _, want, _ = window_inputs(case, dtype=torch.bfloat16)
        calls = []
        got = CpuAttentionBackend(_spy(ops, calls)).forward(
            q, k_cache, v_cache, meta, scale, window=window
        )
        assert calls.count("paged_attention_prefill") == int(kernel), (window, ctx)
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=8e-3)


def test_fused_decode_declines_windowed_and_soft_capped_stacks(ops):
    from pagedserve_kernels.backend import DecoderStack

    w = torch.zeros(1, dtype=torch.bfloat16)
    stack = DecoderStack([w] * 6, w, 1e-6, 4, 1, 256, 0.0625, torch.bfloat16)
    backend = CpuAttentionBackend(ops)
    assert backend.fused_decode(stack) is not None
    for extra in (dict(window=512), dict(softcap=50.0)):
        assert backend.fused_decode(DecoderStack(**{**vars(stack), **extra})) is None, extra
