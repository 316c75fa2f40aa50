"""Non-causal attention over packed segments (vision towers, BERT): the default every backend
inherits (AttentionBackend.encoder_attention) and the helpers its overrides share.

The tokens of every segment (an image, a window of one, a padded sentence) lie back to back in
[num_tokens, num_heads, head_dim]; each query sees exactly its own segment's keys. Segments of
one length run as one batched torch SDPA call, [count, heads, length, head_dim], so a batch of
equal-size images or windows is a single call as before the seam existed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def equal_runs(seq_lens: list[int]) -> list[tuple[int, int]]:
    """(length, how many in a row) for consecutive equal lengths."""
    runs: list[list[int]] = []
    for length in seq_lens:
        if runs and runs[-1][0] == length:
            runs[-1][1] += 1
        else:
            runs.append([length, 1])
    return [(length, count) for length, count in runs]


def cu_seqlens(seq_lens: list[int], device) -> torch.Tensor:
    """[num_segments + 1] int32 offsets (flash-attn's cu_seqlens)."""
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))


def sdpa_segments(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: list[int],
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if sum(seq_lens) != query.shape[0]:
        raise ValueError(f"segments of {sum(seq_lens)} tokens for {query.shape[0]} queries")
    runs = equal_runs(seq_lens)
    if mask is not None and len(runs) != 1:
        raise ValueError("a mask needs segments of one length (a padded batch)")
    heads = query.shape[1]
    out = None if len(runs) == 1 else query.new_empty(query.shape[0], heads, value.shape[-1])
    start = 0
    for length, count in runs:
        span = slice(start, start + length * count)
        q, k, v = (
            t[span].view(count, length, t.shape[1], t.shape[2]).transpose(1, 2)
            for t in (query, key, value)
        )
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        o = o.transpose(1, 2).reshape(-1, heads, o.shape[-1])
        if out is None:
            return o
        out[span] = o
        start += length * count
    return out
