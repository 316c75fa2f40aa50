"""Copy-on-write block copies: KV blocks src -> dst in every KV tensor, before the forward pass.

Every attention backend (CPU C++ kernels, torch reference, Triton, flash-attn) reads the one
layout [num_blocks, block_size, num_kv_heads, head_dim], so one torch gather + scatter per
tensor serves them all, on CPU and on CUDA (index_select then index_copy_: every source is read
before any destination is written, so a block freed and reused as a destination in the same
step still hands its old content to the copies that read it).
"""

from __future__ import annotations

import torch


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies) -> None:
    """copies: (src, dst) block ids, each dst once. Layers that share a KV tensor (one slot of
    several KV cache groups) are copied once."""
    if not copies:
        return
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
    seen: set[int] = set()
    for pair in kv_caches:
        for cache in pair:
            if id(cache) in seen:
                continue
            seen.add(id(cache))
            cache.index_copy_(0, dst, cache.index_select(0, src))
