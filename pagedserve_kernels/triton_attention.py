"""Triton paged attention: our own decode kernel and KV-store kernel.

Decode: one program per (sequence, KV head). The program holds the G query heads that share
that KV head (grouped-query attention), walks the sequence's block table tile by tile and keeps
an online softmax (running max m, running sum l, unnormalised accumulator acc) in float32:

    block_table[s] = [b7, b2, b9, ...]   tile t covers tokens t*BLOCK_N .. t*BLOCK_N+BLOCK_N-1,
                                         all inside physical block block_table[s][t*BLOCK_N // bs]

A sliding window of W keys starts the walk at the tile holding key seq_len - W (the blocks
before it are never read, they may be freed) and masks the keys before it in that tile;
soft-capping replaces each score s by cap * tanh(s / cap) before the softmax.

Prefill and mixed batches go through the torch path (SDPA); decode is where a paged kernel
pays. Both kernels are launched with a grid fixed by the batch size and read lengths from
tensors, so they can be captured in CUDA graphs. Tests run them on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve_kernels.backend import AttentionBackend, AttentionMetadata
from pagedserve_kernels.reference import paged_attention_mixed


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_value_t,
    ROW: tl.constexpr,  # num_kv_heads * head_dim, contiguous within a token
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # negative slots are padding rows (CUDA graph buckets): nothing to store
        offs = tl.arange(0, ROW_PAD)
        mask = offs < ROW
        k = tl.load(key_ptr + token * stride_key_t + offs, mask=mask)
        v = tl.load(value_ptr + token * stride_value_t + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; slot < 0 is skipped
) -> None:
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key, value = _rows_contiguous(key), _rows_contiguous(value)
    row = k_cache.shape[2] * k_cache.shape[3]
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
    )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Each token's [num_kv_heads, head_dim] must be one contiguous row for the store kernel."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


@triton.jit
def _paged_decode_kernel(  # noqa: MFL000 - a Triton kernel is one function by construction
    out_ptr,  # [num_seqs, num_heads, head_dim]
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_table_ptr,  # [num_seqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    scale,
    window,  # keys per query including itself; 0: the whole context
    softcap,  # cap * tanh(s / cap) on the scores where HAS_SOFTCAP
    stride_q_s,
    stride_q_h,
    stride_o_s,
    stride_o_h,
    stride_bt_s,
    stride_c_b,
    stride_c_t,
    stride_c_h,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    BLOCK_N: tl.constexpr,  # tokens per tile; divides BLOCK_SIZE
    HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = 0  # the query at seq_len - 1 sees keys first_key .. seq_len - 1
    if window > 0:
        first_key = tl.maximum(seq_len - window, 0)

    g = tl.arange(0, GROUP_PAD)  # [G]
    d = tl.arange(0, HEAD_DIM_PAD)  # [D]
    n = tl.arange(0, BLOCK_N)  # [N]
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_offs = seq * stride_q_s + heads[:, None] * stride_q_h + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32) * scale  # [G, D]

    m = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    for tile in range(first_key // BLOCK_N, num_tiles):
        start = tile * BLOCK_N
        block_id = tl.load(block_table_ptr + seq * stride_bt_s + start // BLOCK_SIZE).to(tl.int64)
        tok = start % BLOCK_SIZE + n  # [N] offsets inside the physical block
        n_mask = (start + n < seq_len) & (start + n >= first_key)
        kv_offs = (
            block_id * stride_c_b + tok[:, None] * stride_c_t + kv_head * stride_c_h + d[None, :]
        )
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # [N, D]
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, N]
        if HAS_SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])  # [G, N]
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    o = acc / l_sum[:, None]
    o_offs = seq * stride_o_s + heads[:, None] * stride_o_h + d[None, :]
    o_mask = g_mask[:, None] & d_mask[None, :]
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=o_mask)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """window W > 0: each query sees its last W keys; softcap > 0: logit soft-capping."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert query.stride(2) == 1 and num_heads % num_kv_heads == 0
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    group = num_heads // num_kv_heads
    out = torch.empty_like(query) if out is None else out
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out,
        query,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        scale,
        window,
        softcap if softcap > 0 else 1.0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        GROUP=group,
        GROUP_PAD=max(triton.next_power_of_2(group), 2),  # no 1-wide tensors in the kernel
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=min(block_size, _tile_tokens(group, head_dim)),
        HAS_SOFTCAP=softcap > 0,
    )
    return out


def _tile_tokens(group: int, head_dim: int) -> int:
    """Tokens per tile, so the [G, N, D] product of one tile stays near 8K floats."""
    budget = 8192 // (triton.next_power_of_2(group) * triton.next_power_of_2(head_dim))
    return max(16, min(64, triton.next_power_of_2(max(budget, 1))))


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_sliding_window = True
    supports_softcap = True

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
        softcap: float = 0.0,
    ):
        if meta.is_decode_only:
            return paged_decode_attention(
                query, k_cache, v_cache, meta.block_table, meta.seq_lens, scale,
                window=window, softcap=softcap,
            )
        return paged_attention_mixed(
            query, k_cache, v_cache, meta, scale, window=window, softcap=softcap
        )
