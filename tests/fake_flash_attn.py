"""A stand-in `flash_attn` (version 2) in plain torch, written from its documented semantics.

Same signatures and shapes as flash_attn.flash_attn_varlen_func / flash_attn_with_kvcache with
a paged KV cache, the same argument checks that matter to a caller (int32 metadata, block size a
multiple of 256, head counts), and the causal mask aligned to the bottom-right corner:
query i of a sequence with seqlen_q queries and seqlen_k keys sees keys j <= i + seqlen_k -
seqlen_q. window_size=(left, right), not (-1, -1), is local attention: query i sees keys j in
[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right] (-1: unbounded that side;
causal=True bounds the right at 0); only the pages from the one holding the first key any query
sees are read, as the real kernels skip the pages left of every window. softcap > 0: scores
are softcap * tanh(q.k * softmax_scale / softcap) before the mask. Every call is recorded in
`calls` so tests can see which entry point ran.
"""

from __future__ import annotations

import math

import torch

__version__ = "2.8.3.fake"
PAGE_BLOCK_MULTIPLE = 256
calls: list[str] = []


def _check_paged(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor):
    assert block_table.dtype == torch.int32, "block_table must have dtype torch.int32"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert k_cache.shape[1] % PAGE_BLOCK_MULTIPLE == 0, (
        "Paged KV cache block size must be divisible by 256"
    )
    assert k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"


def _first_page_pos(cache: torch.Tensor, seqlen_q: int, seqlen_k: int, window_size) -> int:
    """The first key position read: the start of the page holding the first visible key."""
    left = window_size[0]
    if left < 0:
        return 0
    page = cache.shape[1]
    return max(0, seqlen_k - seqlen_q - left) // page * page


def _paged_kv(cache: torch.Tensor, blocks: torch.Tensor, seqlen_k: int, lo: int = 0):
    """Tokens lo..seqlen_k - 1 of one sequence: [seqlen_k - lo, nheads_k, headdim]."""
    page = cache.shape[1]
    pos = torch.arange(lo, seqlen_k)
    return cache[blocks.long()[pos // page], pos % page]


def _attend(q, k, v, scale: float, causal: bool, window_size, softcap, lk: int, lo: int = 0):
    """q [Lq, H, D], k/v [Lk - lo, Hk, D] (keys lo.. of lk) -> [Lq, H, D]; explicit softmax."""
    lq, nheads, _ = q.shape
    nheads_k = k.shape[1]
    assert nheads % nheads_k == 0, "Number of heads in key/value must divide number of heads"
    group = nheads // nheads_k
    k = k.repeat_interleave(group, dim=1).float()  # head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window_size
    if causal:
        right = 0
    diag = torch.arange(lq)[:, None] + lk - lq  # key position in line with each query
    j = torch.arange(lo, lk)[None, :]
    if right >= 0:
        scores = scores.masked_fill(j > diag + right, float("-inf"))
    if left >= 0:
        scores = scores.masked_fill(j < diag - left, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows give zeros
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """q [total_q, H, D]; with block_table, k/v are [num_blocks, page_block_size, Hk, D],
    without it [total_k, Hk, D] packed like q (the encoder form)."""
    calls.append("flash_attn_varlen_func")
    assert dropout_p == 0.0 and alibi_slopes is None
    window_size = tuple(window_size)
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    if block_table is None:
        return _varlen_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    _check_paged(k, v, block_table)
    batch = cu_seqlens_q.numel() - 1
    assert cu_seqlens_k.numel() == batch + 1 and block_table.shape[0] == batch
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    for b in range(batch):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        seqlen_k = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert q1 - q0 <= max_seqlen_q and seqlen_k <= max_seqlen_k
        lo = _first_page_pos(k, q1 - q0, seqlen_k, window_size)
        kb = _paged_kv(k, block_table[b], seqlen_k, lo)
        vb = _paged_kv(v, block_table[b], seqlen_k, lo)
        out[q0:q1] = _attend(q[q0:q1], kb, vb, scale, causal, window_size, softcap, seqlen_k, lo)
    return out


def _varlen_packed(q, k, v, cu_q, cu_k, softmax_scale, causal):
    assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16"
    assert k.shape[0] == int(cu_k[-1]) and q.shape[0] == int(cu_q[-1])
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        out[q0:q1] = _attend(q[q0:q1], k[k0:k1], v[k0:k1], scale, causal, (-1, -1), 0.0, k1 - k0)
    return out


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """q [B, seqlen_q, H, D]; the KV of sequence b is its first cache_seqlens[b] cached tokens."""
    calls.append("flash_attn_with_kvcache")
    assert k is None and v is None, "this stand-in does not append new KV"
    assert block_table is not None and cache_batch_idx is None and cache_leftpad is None
    _check_paged(k_cache, v_cache, block_table)
    assert q.dim() == 4 and cache_seqlens.dtype == torch.int32
    batch = q.shape[0]
    assert cache_seqlens.shape == (batch,) and block_table.shape[0] == batch
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    window_size = tuple(window_size)
    for b in range(batch):
        seqlen_k = int(cache_seqlens[b])
        lo = _first_page_pos(k_cache, q.shape[1], seqlen_k, window_size)
        kb = _paged_kv(k_cache, block_table[b], seqlen_k, lo)
        vb = _paged_kv(v_cache, block_table[b], seqlen_k, lo)
        out[b] = _attend(q[b], kb, vb, scale, causal, window_size, softcap, seqlen_k, lo)
    return out
