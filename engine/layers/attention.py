"""Paged attention over one layer's KV cache: writes the new tokens' K/V by slot, then attends
through the attention backend (kernels/), which chose its own kernels when it was built."""

from __future__ import annotations

import torch
from torch import nn

from kernels import AttentionBackend, AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:  # [T, H * D]
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = self.backend.forward(q, k_cache, v_cache, meta, self.scale)
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)
