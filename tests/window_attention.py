"""Sliding-window and soft-capped attention cases for every backend's tests, and the definition
they are checked against: a dense masked softmax written here, independent of pagedserve_kernels/.

make_window_batch lays each sequence's K/V into shuffled cache blocks the way the KV manager
does for a sliding-window group: the table entries of blocks wholly before a sequence's first
visible key point at placeholder blocks full of NaN and inf (freed, reused), and the slots past
each length are NaN, so a kernel that reads either surfaces it in the output.
"""

from __future__ import annotations

import torch

from pagedserve_kernels.backend import AttentionMetadata

# (block_size, num_heads, num_kv_heads, head_dim, query_lens, seq_lens, window, softcap): decodes,
# chunked prefill (q_len < kv_len) and whole prompts, windows shorter than, equal to and longer
# than the context, windows that start mid-block and on a block boundary.
WINDOW_CASES = [
    (16, 4, 1, 64, [1, 1, 1, 1], [40, 8, 16, 17], 8, 0.0),  # decode, W 8 < / = / > context
    (16, 8, 2, 64, [1, 9, 40, 1], [70, 30, 40, 33], 16, 0.0),  # W = block size, a whole prompt
    (8, 6, 2, 32, [5, 1, 12, 3], [29, 64, 12, 7], 13, 0.0),  # W mid-block, W > some contexts
    (16, 4, 4, 64, [1, 7, 20, 1], [50, 20, 20, 3], 0, 30.0),  # softcap alone
    (16, 8, 2, 64, [1, 6, 33, 1, 2], [100, 45, 33, 9, 64], 24, 20.0),  # window and softcap
    (16, 4, 1, 256, [1, 17, 1], [300, 64, 128], 32, 50.0),  # Gemma's head_dim 256, MQA
    (16, 4, 2, 64, [1, 3], [1, 3], 1, 0.0),  # W = 1: each query sees only itself
    (16, 4, 2, 64, [100, 1, 70], [150, 120, 70], 20, 10.0),  # long runs of queries past W
]
POISON_BLOCKS = 2  # the placeholder ids a KV manager puts behind the window: NaN and inf


def case_id(c) -> str:
    return f"bs{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-q{c[4]}-kv{c[5]}-w{c[6]}-c{c[7]:g}"


def ragged_meta(block_table, query_lens, seq_lens) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def make_window_batch(block_size, num_kv_heads, head_dim, query_lens, seq_lens, window, seed=0):
    """(dense [(k, v)] per sequence, k_cache, v_cache, block_table, skipped blocks per sequence)."""
    gen = torch.Generator().manual_seed(seed)
    dense = [
        (torch.randn(n, num_kv_heads, head_dim, generator=gen),
         torch.randn(n, num_kv_heads, head_dim, generator=gen))
        for n in seq_lens
    ]
    num_blocks = [-(n // -block_size) for n in seq_lens]
    skipped = [
        min(nb, max(0, kv - q - window + 1) // block_size) if window > 0 else 0
        for nb, q, kv in zip(num_blocks, query_lens, seq_lens)
    ]
    total = POISON_BLOCKS + sum(nb - s for nb, s in zip(num_blocks, skipped))
    shape = (total, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    k_cache[1], v_cache[1] = float("inf"), float("-inf")
    perm = (torch.randperm(total - POISON_BLOCKS, generator=gen) + POISON_BLOCKS).tolist()
    block_table = torch.zeros(len(seq_lens), max(num_blocks), dtype=torch.int32)
    for i, (k, v) in enumerate(dense):
        for b in range(num_blocks[i]):
            if b < skipped[i]:
                block_table[i, b] = b % POISON_BLOCKS  # freed: a placeholder id
                continue
            block_table[i, b] = phys = perm.pop()
            rows = slice(b * block_size, min((b + 1) * block_size, seq_lens[i]))
            n = rows.stop - rows.start
            k_cache[phys, :n], v_cache[phys, :n] = k[rows], v[rows]
    return dense, k_cache, v_cache, block_table, skipped


def dense_windowed_attention(q, k, v, q_pos, scale, window, softcap):
    """The definition, head by head in float64: q [Lq, H, D] at absolute positions q_pos, k/v
    [Lk, Hkv, D] with key j at position j; query i sees i - window < j <= i (all j <= i at 0);
    scores softcap * tanh(score / softcap) when softcap > 0."""
    group = q.shape[1] // k.shape[1]
    j = torch.arange(k.shape[0])[None, :]
    allowed = j <= q_pos[:, None]
    if window > 0:
        allowed &= j > q_pos[:, None] - window
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[1]):
        s = (q[:, h].double() @ k[:, h // group].double().T) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        p = s.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[:, h] = p @ v[:, h // group].double()
    return out


def window_inputs(case, seed=0, dtype=torch.float32):
    """(q, k_cache, v_cache, meta, scale, window, softcap, want [T, H, D] float64, skipped), the
    inputs rounded to dtype first so `want` is exact for them."""
    block_size, num_heads, num_kv_heads, head_dim, query_lens, seq_lens, window, softcap = case
    dense, k_cache, v_cache, block_table, skipped = make_window_batch(
        block_size, num_kv_heads, head_dim, query_lens, seq_lens, window, seed
    )
    gen = torch.Generator().manual_seed(seed + 9)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    meta = ragged_meta(block_table, query_lens, seq_lens)
    scale = head_dim**-0.5
    want, start = [], 0
    for (k, v), q_len, kv_len in zip(dense, query_lens, seq_lens):
        q_pos = torch.arange(kv_len - q_len, kv_len)
        rows = q[start : start + q_len]
        k, v = k.to(dtype), v.to(dtype)
        want.append(dense_windowed_attention(rows, k, v, q_pos, scale, window, softcap))
        start += q_len
    return q, k_cache, v_cache, meta, scale, window, softcap, torch.cat(want), skipped
